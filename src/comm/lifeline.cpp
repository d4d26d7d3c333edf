// The lifeline's agreement (comm/lifeline.hpp).
#include "comm/lifeline.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <random>

#include "bootstrap/store.hpp"
#include "comm/connect.hpp"
#include "core/log.hpp"
#include "net/auth.hpp"
#include "transport/mesh.hpp"
#include "transport/transport.hpp"

namespace kolo {
namespace {

// The hello's stream field says what a lifeline connection is for.
constexpr uint32_t kReport = 1;

// Seconds for one connection attempt to a peer's listener: the kernel answers at once on a live
// host; a host that does not answer in this long counts as gone.
constexpr double kProbeSeconds = 5.0;
// Seconds for the handshake of a connection accepted by a coordinator that is already running.
constexpr double kHandshakeSeconds = 2.0;
// How many timeouts a coordinator waits for the reports: a survivor may be inside another
// blocking call when the rank is lost (a split connecting its new communicator waits up to the
// timeout for the lost member) and only then fail and come.
constexpr double kReportTimeouts = 2.0;

// What the coordinator and its followers say to each other after the handshake: a header, then
// `bytes` of payload.
enum Word : uint32_t {
  kDecision = 1,  // payload: context (8), member count (4), members (4 each), store address
  kCommit = 2,
  kAbort = 3,  // value: the status; payload: the message
  kBuilt = 4,  // follower to coordinator; value: 0 or the status; payload: the message
};
constexpr uint32_t kWordMagic = 0x6b6c6966;  // "kolo lifeline"
constexpr uint32_t kMaxWordBytes = 1u << 20;

struct WordHeader {
  uint32_t magic = kWordMagic;
  uint32_t word = 0;
  int32_t value = 0;
  uint32_t bytes = 0;
};
static_assert(sizeof(WordHeader) == 16);

struct Message {
  Word word{};
  int32_t value = 0;
  std::vector<uint8_t> payload;
};

void send_word(const net::Socket& socket, Word word, int32_t value,
               const std::vector<uint8_t>& payload, const Deadline& deadline) {
  WordHeader header;
  header.word = word;
  header.value = value;
  header.bytes = static_cast<uint32_t>(payload.size());
  net::send_all(socket, &header, sizeof header, deadline);
  if (!payload.empty()) net::send_all(socket, payload.data(), payload.size(), deadline);
}

Message recv_word(const net::Socket& socket, const Deadline& deadline, int peer) {
  WordHeader header;
  net::recv_all(socket, &header, sizeof header, deadline);
  if (header.magic != kWordMagic || header.bytes > kMaxWordBytes || header.word < kDecision ||
      header.word > kBuilt) {
    throw Error(Status::kMismatch,
                fmt::format("kolo_comm_shrink: rank {} sent a malformed message", peer));
  }
  Message message;
  message.word = static_cast<Word>(header.word);
  message.value = header.value;
  message.payload.resize(header.bytes);
  if (header.bytes) net::recv_all(socket, message.payload.data(), header.bytes, deadline);
  return message;
}

std::vector<uint8_t> text_bytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::vector<uint8_t> encode(const ShrinkDecision& decision) {
  std::vector<uint8_t> bytes(12 + 4 * decision.members.size());
  const auto count = static_cast<uint32_t>(decision.members.size());
  std::memcpy(bytes.data(), &decision.context, 8);
  std::memcpy(bytes.data() + 8, &count, 4);
  std::memcpy(bytes.data() + 12, decision.members.data(), 4 * decision.members.size());
  bytes.insert(bytes.end(), decision.store.begin(), decision.store.end());
  return bytes;
}

// Checks what it reads: the members must be increasing ranks of the old communicator.
ShrinkDecision decode(const std::vector<uint8_t>& bytes, int size, int coordinator) {
  ShrinkDecision decision;
  uint32_t count = 0;
  bool good = bytes.size() >= 12;
  if (good) {
    std::memcpy(&decision.context, bytes.data(), 8);
    std::memcpy(&count, bytes.data() + 8, 4);
    good = count >= 1 && count <= static_cast<uint32_t>(size) && bytes.size() >= 12 + 4 * count;
  }
  if (good) {
    decision.members.resize(count);
    std::memcpy(decision.members.data(), bytes.data() + 12, 4 * count);
    decision.store.assign(bytes.begin() + 12 + 4 * count, bytes.end());
    for (uint32_t i = 0; i < count; ++i) {
      const int member = decision.members[i];
      good = good && member >= 0 && member < size && (i == 0 || member > decision.members[i - 1]);
    }
  }
  if (!good) {
    throw Error(Status::kMismatch,
                fmt::format("kolo_comm_shrink: the decision of rank {} is malformed", coordinator));
  }
  return decision;
}

uint64_t fresh_context() {
  std::random_device device;
  uint64_t context = 0;
  while (context <= 1) context = (uint64_t{device()} << 32) ^ device();
  return context & ~(uint64_t{1} << 63);  // the top bit is a fusion engine's (communicator.cpp)
}

// Whether a socket that nobody writes to has been closed or reset by the other end: poll says
// readable, and no byte is waiting. A byte waiting means the other end accepted and spoke.
enum class Peek { kQuiet, kClosed, kSpoke };
Peek peek(const net::Socket& socket) {
  pollfd entry{socket.fd(), POLLIN, 0};
  if (::poll(&entry, 1, 0) <= 0) return Peek::kQuiet;
  uint8_t byte = 0;
  const ssize_t got = ::recv(socket.fd(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (got > 0) return Peek::kSpoke;
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Peek::kQuiet;
  return Peek::kClosed;
}

std::string list_ranks(const std::vector<int>& ranks) { return fmt::format("{}", fmt::join(ranks, ", ")); }

}  // namespace

Lifeline::Lifeline(const Config& config, StoreClient& store, uint64_t context)
    : rank_(config.rank),
      size_(config.size),
      context_(context),
      secret_(config.secret),
      timeout_s_(config.timeout_s) {
  host_ = mesh_listen_host(transport_settings(config), store, rank_, size_, context_, "lifeline");
  listener_ = net::listen_on({host_, 0});
  const net::Endpoint me = net::local_endpoint(listener_);
  store.set_string(store_key(context_, "lifeline", rank_), me.to_string());
  addresses_.resize(static_cast<size_t>(size_));
  for (int peer = 0; peer < size_; ++peer) {
    addresses_[peer] = peer == rank_ ? me
                                     : net::parse_endpoint(store.get_string(store_key(
                                                               context_, "lifeline", peer)),
                                                           "a lifeline address");
  }
}

ShrinkDecision Lifeline::agree(const Steps& steps) {
  std::vector<bool> gone(static_cast<size_t>(size_), false);
  for (;;) {
    net::Socket link;
    const int coordinator = find_coordinator(gone, link);
    if (coordinator == rank_) return coordinate(gone, steps);
    log::info("kolo_comm_shrink: rank {} reports to rank {}, the lowest rank alive", rank_,
              coordinator);
    std::optional<ShrinkDecision> decision = follow(coordinator, link, steps);
    if (decision) return *decision;
    gone[coordinator] = true;  // lost before it decided: the next rank alive coordinates
  }
}

int Lifeline::find_coordinator(std::vector<bool>& gone, net::Socket& link) {
  for (int candidate = 0; candidate < rank_; ++candidate) {
    if (gone[candidate]) continue;
    std::string why;
    link = net::connect_once(addresses_[candidate],
                             Deadline(std::min(kProbeSeconds, timeout_s_)), &why);
    if (!link.valid()) {
      log::info("kolo_comm_shrink: rank {} is gone ({})", candidate, why);
      gone[candidate] = true;
      continue;
    }
    // It lives: wait until it takes part (accepts), as long as a coordinator waits for reports.
    const double wait_s = kReportTimeouts * timeout_s_ + kProbeSeconds;
    try {
      net::authenticate_as_client(link, secret_,
                                  net::Hello{net::kPurposeLifeline, rank_, kReport, context_},
                                  Deadline(wait_s));
    } catch (const Error& error) {
      if (error.status() == Status::kTimeout) {
        throw Error(Status::kTimeout,
                    fmt::format("kolo_comm_shrink: rank {} is alive but did not answer within "
                                "{:.3g} s: either it never called kolo_comm_shrink, or the "
                                "survivors shrank without this rank, which came too late",
                                candidate, wait_s));
      }
      if (error.status() != Status::kPeerLost) throw;
      log::info("kolo_comm_shrink: rank {} was lost before it took part ({})", candidate,
                error.what());
      gone[candidate] = true;
      continue;
    }
    return candidate;
  }
  link.close();
  return rank_;
}

std::optional<ShrinkDecision> Lifeline::follow(int coordinator, net::Socket& link, const Steps& steps) {
  // The coordinator's longest silences: its wait for reports, then a build (up to the timeout).
  const double word_seconds = (kReportTimeouts + 1) * timeout_s_ + 2 * kProbeSeconds;
  std::optional<ShrinkDecision> decision;
  bool built = false;
  for (;;) {
    Message message;
    try {
      message = recv_word(link, Deadline(word_seconds), coordinator);
    } catch (const Error& error) {
      if (error.status() != Status::kPeerLost && error.status() != Status::kTimeout) throw;
      steps.discard();
      if (!decision) {
        log::warn("kolo_comm_shrink: rank {}, the coordinator, was lost before it decided ({}); "
                  "looking for the next one",
                  coordinator, error.what());
        return std::nullopt;
      }
      throw Error(Status::kPeerLost,
                  fmt::format("kolo_comm_shrink: rank {}, the coordinator, was lost after it "
                              "decided and before every member had connected ({}); no "
                              "communicator was formed here: call kolo_comm_shrink again",
                              coordinator, error.what()));
    }
    const Deadline reply(timeout_s_);
    switch (message.word) {
      case kDecision: {
        steps.discard();
        decision = decode(message.payload, size_, coordinator);
        if (!std::binary_search(decision->members.begin(), decision->members.end(), rank_)) {
          throw Error(Status::kMismatch, fmt::format("kolo_comm_shrink: rank {} decided on "
                                                     "members that leave out this rank",
                                                     coordinator));
        }
        log::info("kolo_comm_shrink: rank {} decided on ranks {}; connecting", coordinator,
                  list_ranks(decision->members));
        int32_t status = 0;
        std::string failure;
        try {
          steps.build(*decision);
          built = true;
        } catch (const Error& error) {
          built = false;
          status = static_cast<int32_t>(error.status());
          failure = error.what();
        } catch (const std::exception& error) {
          built = false;
          status = static_cast<int32_t>(Status::kSystem);
          failure = error.what();
        }
        send_word(link, kBuilt, status, text_bytes(failure), reply);
        break;
      }
      case kCommit:
        if (!decision || !built) {
          throw Error(Status::kMismatch, fmt::format("kolo_comm_shrink: rank {} committed what "
                                                     "this rank could not build",
                                                     coordinator));
        }
        return *decision;
      case kAbort: {
        steps.discard();
        Status status = Status::kInternal;
        status_from_wire(message.value, status);
        throw Error(status, std::string(message.payload.begin(), message.payload.end()));
      }
      default:
        throw Error(Status::kMismatch, fmt::format("kolo_comm_shrink: rank {} sent an "
                                                   "unexpected message",
                                                   coordinator));
    }
  }
}

ShrinkDecision Lifeline::coordinate(std::vector<bool>& gone, const Steps& steps) {
  const Deadline until(kReportTimeouts * timeout_s_);
  std::map<int, net::Socket> probes;     // rank -> a connection that says nothing
  std::map<int, net::Socket> followers;  // rank -> its report connection
  for (int peer = rank_ + 1; peer < size_; ++peer) {
    if (gone[peer]) continue;
    std::string why;
    net::Socket probe = net::connect_once(
        addresses_[peer], Deadline(std::min(kProbeSeconds, std::max(until.remaining_s(), 0.1))),
        &why);
    if (probe.valid()) {
      probes.emplace(peer, std::move(probe));
    } else {
      log::info("kolo_comm_shrink: rank {} is gone ({})", peer, why);
      gone[peer] = true;
    }
  }
  log::info("kolo_comm_shrink: rank {} coordinates; waiting for rank(s) {}", rank_, [&] {
    std::vector<int> alive;
    for (const auto& [peer, socket] : probes) alive.push_back(peer);
    return list_ranks(alive);
  }());

  auto abort_followers = [&](const Error& error) {
    for (auto& [peer, socket] : followers) {
      try {
        send_word(socket, kAbort, static_cast<int32_t>(error.status()), text_bytes(error.what()),
                  Deadline(kHandshakeSeconds));
      } catch (const Error&) {
        // It will see its connection close.
      }
    }
    steps.discard();
  };

  // Step 2: reports, until every probed rank has reported or is gone.
  while (!probes.empty() && !until.expired()) {
    std::vector<pollfd> entries{{listener_.fd(), POLLIN, 0}};
    for (const auto& [peer, socket] : probes) entries.push_back({socket.fd(), POLLIN, 0});
    for (const auto& [peer, socket] : followers) entries.push_back({socket.fd(), POLLIN, 0});
    if (::poll(entries.data(), entries.size(), std::min(until.remaining_ms(), 100)) < 0 &&
        errno != EINTR) {
      throw Error(Status::kSystem, fmt::format("kolo_comm_shrink: poll: {}", std::strerror(errno)));
    }
    for (auto it = probes.begin(); it != probes.end();) {
      const Peek seen = peek(it->second);
      if (seen == Peek::kSpoke) {
        const Error conflict(
            Status::kPeerLost,
            fmt::format("kolo_comm_shrink: ranks {} and {} both coordinate (rank {} could not "
                        "reach rank {}); no communicator is formed: check the network between "
                        "them",
                        rank_, it->first, it->first, rank_));
        abort_followers(conflict);
        throw conflict;
      }
      if (seen == Peek::kClosed) {
        log::info("kolo_comm_shrink: rank {} was lost before it reported", it->first);
        gone[it->first] = true;
        it = probes.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = followers.begin(); it != followers.end();) {
      if (peek(it->second) != Peek::kQuiet) {  // a follower says nothing until the decision
        log::info("kolo_comm_shrink: rank {} was lost after it reported", it->first);
        gone[it->first] = true;
        it = followers.erase(it);
      } else {
        ++it;
      }
    }
    if (entries[0].revents & POLLIN) {
      net::Socket socket = net::accept_from(listener_, Deadline(kHandshakeSeconds));
      try {
        const net::Hello hello =
            net::authenticate_as_server(socket, secret_, Deadline(kHandshakeSeconds));
        if (hello.purpose != net::kPurposeLifeline || hello.context != context_ ||
            hello.stream != kReport || hello.rank <= rank_ || hello.rank >= size_ ||
            !probes.count(hello.rank)) {
          log::warn("kolo_comm_shrink: dropped a connection from {} (rank {}, purpose {}) that "
                    "is no report of this communicator's survivors",
                    net::peer_endpoint(socket).to_string(), hello.rank, hello.purpose);
        } else {
          probes.erase(hello.rank);
          followers.emplace(hello.rank, std::move(socket));
        }
      } catch (const Error& error) {
        log::info("kolo_comm_shrink: dropped a connection that did not report: {}", error.what());
      }
    }
  }
  if (!probes.empty()) {
    std::vector<int> late;
    for (const auto& [peer, socket] : probes) late.push_back(peer);
    log::warn("kolo_comm_shrink: rank(s) {} live but did not call kolo_comm_shrink within {:.3g} "
              "s: they are left out",
              list_ranks(late), kReportTimeouts * timeout_s_);
    probes.clear();  // they see their connections refused, or time out, and fail
  }

  // Steps 3 and 4: decide, build, commit; decide again without a member that is lost meanwhile.
  ShrinkDecision decision;
  decision.store = steps.serve_store();
  for (;;) {
    decision.members = {rank_};
    for (const auto& [peer, socket] : followers) decision.members.push_back(peer);
    decision.context = fresh_context();
    log::info("kolo_comm_shrink: rank {} decides on ranks {}, context {:x}, store {}", rank_,
              list_ranks(decision.members), decision.context, decision.store);
    const std::vector<uint8_t> payload = encode(decision);
    std::vector<int> lost;
    for (auto& [peer, socket] : followers) {
      try {
        send_word(socket, kDecision, 0, payload, Deadline(kHandshakeSeconds));
      } catch (const Error&) {
        lost.push_back(peer);
      }
    }
    std::optional<Error> failure;
    if (lost.empty()) {
      try {
        steps.build(decision);
      } catch (const Error& error) {
        failure.emplace(error.status(), fmt::format("kolo_comm_shrink: rank {} could not connect "
                                                    "the new communicator: {}",
                                                    rank_, error.what()));
      } catch (const std::exception& error) {
        failure.emplace(Status::kSystem, fmt::format("kolo_comm_shrink: rank {} could not "
                                                     "connect the new communicator: {}",
                                                     rank_, error.what()));
      }
      for (auto& [peer, socket] : followers) {
        try {
          Message built = recv_word(socket, Deadline(timeout_s_ + kProbeSeconds), peer);
          if (built.word != kBuilt) {
            throw Error(Status::kMismatch,
                        fmt::format("kolo_comm_shrink: rank {} answered out of turn", peer));
          }
          if (built.value != 0 && !failure) {
            Status status = Status::kInternal;
            status_from_wire(built.value, status);
            failure.emplace(status, fmt::format("kolo_comm_shrink: rank {} could not connect "
                                                "the new communicator: {}",
                                                peer, std::string(built.payload.begin(),
                                                                  built.payload.end())));
          }
        } catch (const Error& error) {
          if (error.status() != Status::kPeerLost && error.status() != Status::kTimeout) throw;
          lost.push_back(peer);
        }
      }
    }
    if (!lost.empty()) {
      // A member lost explains the others' failures to connect: decide again without it.
      log::warn("kolo_comm_shrink: rank(s) {} lost while the new communicator was formed; "
                "deciding again without",
                list_ranks(lost));
      for (int peer : lost) {
        followers.erase(peer);
        gone[peer] = true;
      }
      steps.discard();
      continue;
    }
    if (failure) {
      abort_followers(*failure);
      throw *failure;
    }
    for (auto& [peer, socket] : followers) {
      try {
        send_word(socket, kCommit, 0, {}, Deadline(kHandshakeSeconds));
      } catch (const Error& error) {
        // The member was lost after it connected: the new communicator's first call there fails.
        log::warn("kolo_comm_shrink: could not commit to rank {}: {}", peer, error.what());
      }
    }
    log::info("kolo_comm_shrink: committed ranks {}", list_ranks(decision.members));
    return decision;
  }
}

}  // namespace kolo

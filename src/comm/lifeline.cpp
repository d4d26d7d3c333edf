// The lifeline's agreement (comm/lifeline.hpp).
#include "comm/lifeline.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <utility>

#include "bootstrap/store.hpp"
#include "core/log.hpp"
#include "net/auth.hpp"
#include "net/gate.hpp"
#include "transport/transport.hpp"

namespace kolo {
namespace {

// Seconds at least for reaching a peer's lifeline: the kernel answers at once on a live host, and
// its thread admits at once; strangers may push the attempt out a few times first.
constexpr double kProbeSeconds = 5.0;
// Seconds for a word to a peer that is alive, when it may be gone.
constexpr double kHandshakeSeconds = 2.0;
// How many timeouts a coordinator waits for the reports: a survivor may be inside another
// blocking call when the rank is lost (a split connecting its new communicator waits up to the
// timeout for the lost member) and only then fail and come.
constexpr double kReportTimeouts = 2.0;

using lifeline_wire::Message;
using lifeline_wire::text_bytes;

// The hello's stream field says what a lifeline connection is for.
constexpr uint32_t kReport = 1;  // a follower's report to its coordinator
constexpr uint32_t kWatch = 2;   // a coordinator's connection that says nothing, held open

void send_word(const net::Socket& socket, lifeline_wire::Word word, int32_t value,
               const std::vector<uint8_t>& payload, const Deadline& deadline) {
  lifeline_wire::Header header;
  header.word = word;
  header.value = value;
  header.bytes = static_cast<uint32_t>(payload.size());
  net::send_all(socket, &header, sizeof header, deadline);
  if (!payload.empty()) net::send_all(socket, payload.data(), payload.size(), deadline);
}

Message recv_word(const net::Socket& socket, const Deadline& deadline, int peer) {
  lifeline_wire::Header header;
  net::recv_all(socket, &header, sizeof header, deadline);
  lifeline_wire::check_header(header, peer);
  Message message;
  message.word = static_cast<lifeline_wire::Word>(header.word);
  message.value = header.value;
  message.payload.resize(header.bytes);
  if (header.bytes) net::recv_all(socket, message.payload.data(), header.bytes, deadline);
  return message;
}

// Tells a peer why; best effort: it sees the connection close either way.
void send_abort(const net::Socket& socket, const Error& error) {
  try {
    send_word(socket, lifeline_wire::kAbort, static_cast<int32_t>(error.status()),
              text_bytes(error.what()), Deadline(kHandshakeSeconds));
  } catch (const Error&) {
  }
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

Lifeline::Lifeline(const Config& config, uint64_t context, net::Socket listener, std::string host)
    : rank_(config.rank),
      size_(config.size),
      context_(context),
      secret_(config.secret),
      timeout_s_(config.timeout_s),
      wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (!wake_.valid()) {
    throw Error(Status::kSystem, fmt::format("lifeline: eventfd: {}", std::strerror(errno)));
  }
  host_ = std::move(host);
  gate_ = std::make_unique<net::Gate>(
      std::move(listener), secret_, "lifeline", [this](const net::Hello& hello) {
        if (hello.purpose != net::kPurposeLifeline || hello.context != context_) {
          return fmt::format("is no lifeline connection of communicator {:x}", context_);
        }
        if (hello.rank < 0 || hello.rank >= size_ || hello.rank == rank_ ||
            (hello.stream != kReport && hello.stream != kWatch)) {
          return fmt::format("says it is rank {} stream {}, which this rank does not expect",
                             hello.rank, hello.stream);
        }
        return std::string();
      });
}

Lifeline::Lifeline(const Config& config, StoreClient& store, uint64_t context,
                   const std::string& listen_host)
    : Lifeline(config, context, net::listen_on({listen_host, 0}), listen_host) {
  const net::Endpoint me = gate_->endpoint();
  store.set_string(store_key(context_, "lifeline", rank_), me.to_string());
  // Every other rank's lifeline address, in one request.
  std::vector<std::string> keys;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) keys.push_back(store_key(context_, "lifeline", peer));
  }
  const std::vector<std::string> others = store.get_all_strings(keys);
  addresses_.resize(static_cast<size_t>(size_));
  for (int peer = 0; peer < size_; ++peer) {
    const size_t other = static_cast<size_t>(peer < rank_ ? peer : peer - 1);
    addresses_[peer] =
        peer == rank_ ? me : net::parse_endpoint(others[other], "a lifeline address");
  }
  thread_ = std::thread([this] { serve(); });
}

Lifeline::Lifeline(const Config& config, uint64_t context, net::Socket listener,
                   const std::vector<std::string>& addresses, const std::string& host)
    : Lifeline(config, context, std::move(listener), std::string()) {
  host_ = host.empty() ? gate_->endpoint().host : host;
  if (addresses.size() != static_cast<size_t>(size_)) {
    throw Error(Status::kInternal,
                fmt::format("lifeline: {} addresses for {} ranks", addresses.size(), size_));
  }
  addresses_.resize(static_cast<size_t>(size_));
  for (int peer = 0; peer < size_; ++peer) {
    addresses_[peer] =
        peer == rank_ ? net::Endpoint{host_, gate_->endpoint().port}
                      : net::parse_endpoint(addresses[peer], fmt::format("the lifeline address of "
                                                                         "rank {}",
                                                                         peer));
  }
  thread_ = std::thread([this] { serve(); });
}

Lifeline::~Lifeline() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  const uint64_t one = 1;
  (void)!::write(wake_.fd(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();  // not when a constructor failed before starting it
}

void Lifeline::serve() {
  std::vector<int> watching;  // the ranks of watchers_, in the order polled
  for (;;) {
    std::vector<pollfd> entries{{wake_.fd(), POLLIN, 0}, {gate_->fd(), POLLIN, 0}};
    watching.clear();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) return;
      for (const auto& [peer, socket] : watchers_) {
        entries.push_back({socket.fd(), POLLIN, 0});
        watching.push_back(peer);
      }
    }
    if (::poll(entries.data(), entries.size(), gate_->timeout_ms()) < 0 && errno != EINTR) {
      log::warn("lifeline: poll failed ({}); no more connections are admitted",
                std::strerror(errno));
      return;
    }
    std::vector<net::Gate::Admitted> admitted = gate_->advance();
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) return;
    for (size_t i = 0; i < watching.size(); ++i) {
      // A watcher says nothing: readable means its coordinator closed it, or died.
      auto it = watchers_.find(watching[i]);
      if (entries[2 + i].revents != 0 && it != watchers_.end() && peek(it->second) != Peek::kQuiet) {
        watchers_.erase(it);
      }
    }
    for (net::Gate::Admitted& connection : admitted) {
      const int peer = connection.hello.rank;
      net::set_nonblocking(connection.socket, false);
      if (committed_coordinator_ && (connection.hello.stream == kReport || peer < rank_)) {
        send_abort(connection.socket, Error(Status::kPeerLost, turned_away_));
        continue;
      }
      auto& kept = connection.hello.stream == kReport ? reports_ : watchers_;
      kept[peer] = std::move(connection.socket);  // a later one replaces an earlier attempt
    }
  }
}

std::map<int, net::Socket> Lifeline::take_reports() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(reports_, {});
}

void Lifeline::settle(const Error& failure) {
  std::lock_guard<std::mutex> lock(mutex_);
  coordinating_ = false;
  for (auto& [peer, socket] : reports_) send_abort(socket, failure);
  reports_.clear();
}

void Lifeline::settle(const ShrinkDecision& decision, int coordinator) {
  std::lock_guard<std::mutex> lock(mutex_);
  coordinating_ = false;
  committed_coordinator_ = coordinator;
  turned_away_ = fmt::format("kolo_comm_shrink: rank {} already committed to a communicator of "
                             "ranks {} coordinated by rank {}; no communicator was formed with "
                             "this rank",
                             rank_, list_ranks(decision.members), coordinator);
  const Error late(Status::kPeerLost, turned_away_);
  for (auto& [peer, socket] : reports_) send_abort(socket, late);
  reports_.clear();
  // A lower rank watching this one coordinates without it: it must not go on.
  for (auto& [peer, socket] : watchers_) {
    if (peer < rank_ && peer != coordinator) send_abort(socket, late);
  }
}

ShrinkDecision Lifeline::agree(const Steps& steps) {
  std::vector<bool> gone(static_cast<size_t>(size_), false);
  // A coordinator that closes the connection before deciding sends its followers looking again;
  // they find it gone, or report anew. This bounds how often.
  const Deadline overall((kReportTimeouts + 2) * timeout_s_ + 2 * kProbeSeconds);
  try {
    for (;;) {
      net::Socket link;
      const int coordinator = find_coordinator(gone, link);
      if (coordinator == rank_) {
        ShrinkDecision decision = coordinate(gone, steps);
        settle(decision, rank_);
        return decision;
      }
      log::info("kolo_comm_shrink: rank {} reports to rank {}, the lowest rank alive", rank_,
                coordinator);
      if (std::optional<ShrinkDecision> decision = follow(coordinator, link, steps)) {
        settle(*decision, coordinator);
        return *decision;
      }
      if (overall.expired()) {
        throw Error(Status::kTimeout,
                    fmt::format("kolo_comm_shrink: no coordinator decided within {:.3g} s; no "
                                "communicator was formed: call kolo_comm_shrink again",
                                (kReportTimeouts + 2) * timeout_s_ + 2 * kProbeSeconds));
      }
    }
  } catch (const Error& error) {
    settle(error);
    throw;
  }
}

int Lifeline::find_coordinator(std::vector<bool>& gone, net::Socket& link) {
  for (int candidate = 0; candidate < rank_; ++candidate) {
    if (gone[candidate]) continue;
    std::string why;
    const double wait_s = std::max(kProbeSeconds, timeout_s_);
    switch (net::reach_authenticated(addresses_[candidate], secret_,
                                     net::Hello{net::kPurposeLifeline, rank_, kReport, context_},
                                     Deadline(wait_s), &link, &why)) {
      case net::Reach::kAdmitted:
        return candidate;
      case net::Reach::kGone:
        log::info("kolo_comm_shrink: rank {} is gone ({})", candidate, why);
        gone[candidate] = true;
        continue;
      case net::Reach::kSilent:
        throw Error(Status::kTimeout,
                    fmt::format("kolo_comm_shrink: rank {} did not take this rank's report within "
                                "{:.3g} s ({}), and nothing says it is gone; no communicator was "
                                "formed: call kolo_comm_shrink again, or check the network "
                                "between the two",
                                candidate, wait_s, why));
    }
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
      steps.discard();
      if (error.status() == Status::kPeerLost && !decision) {
        log::warn("kolo_comm_shrink: rank {}, the coordinator, closed the connection before it "
                  "decided ({}); looking for the coordinator again",
                  coordinator, error.what());
        return std::nullopt;
      }
      if (error.status() != Status::kPeerLost && error.status() != Status::kTimeout) throw;
      throw Error(error.status(),
                  fmt::format("kolo_comm_shrink: rank {}, the coordinator, {} ({}); no "
                              "communicator was formed here: call kolo_comm_shrink again",
                              coordinator,
                              decision ? "was lost after it decided and before every member had "
                                         "connected"
                                       : fmt::format("decided nothing within {:.3g} s",
                                                     word_seconds),
                              error.what()));
    }
    const Deadline reply(timeout_s_);
    switch (message.word) {
      case lifeline_wire::kDecision: {
        steps.discard();
        decision = lifeline_wire::decode(message.payload, size_, coordinator);
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
        send_word(link, lifeline_wire::kBuilt, status, text_bytes(failure), reply);
        break;
      }
      case lifeline_wire::kCommit:
        if (!decision || !built) {
          throw Error(Status::kMismatch, fmt::format("kolo_comm_shrink: rank {} committed what "
                                                     "this rank could not build",
                                                     coordinator));
        }
        return *decision;
      case lifeline_wire::kAbort:
        steps.discard();
        throw lifeline_wire::abort_error(message, coordinator);
      default:
        throw Error(Status::kMismatch, fmt::format("kolo_comm_shrink: rank {} sent an "
                                                   "unexpected message",
                                                   coordinator));
    }
  }
}

ShrinkDecision Lifeline::coordinate(std::vector<bool>& gone, const Steps& steps) {
  const Deadline until(kReportTimeouts * timeout_s_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    coordinating_ = true;
  }
  std::map<int, net::Socket> followers;  // rank -> its report connection
  std::map<int, net::Socket> watches;    // rank -> a connection that says nothing

  auto fail = [&](const Error& error) {
    for (auto& [peer, socket] : followers) send_abort(socket, error);
    steps.discard();
    return error;
  };
  auto take_reports = [&] {
    for (auto& [peer, socket] : this->take_reports()) {
      watches.erase(peer);
      gone[peer] = false;  // it reported: whatever said it was gone was wrong
      followers[peer] = std::move(socket);
    }
  };

  take_reports();
  for (int peer = rank_ + 1; peer < size_; ++peer) {
    if (gone[peer] || followers.count(peer)) continue;
    std::string why;
    net::Socket watch;
    switch (net::reach_authenticated(addresses_[peer], secret_,
                                     net::Hello{net::kPurposeLifeline, rank_, kWatch, context_},
                                     Deadline(std::max(kProbeSeconds, timeout_s_)), &watch,
                                     &why)) {
      case net::Reach::kAdmitted:
        watches.emplace(peer, std::move(watch));
        break;
      case net::Reach::kGone:
        log::info("kolo_comm_shrink: rank {} is gone ({})", peer, why);
        gone[peer] = true;
        break;
      case net::Reach::kSilent:
        throw fail(Error(Status::kTimeout,
                         fmt::format("kolo_comm_shrink: rank {} did not answer rank {}, the "
                                     "coordinator, ({}), and nothing says it is gone; no "
                                     "communicator was formed: call kolo_comm_shrink again, or "
                                     "check the network between the two",
                                     peer, rank_, why)));
    }
  }
  log::info("kolo_comm_shrink: rank {} coordinates; waiting for rank(s) {}", rank_, [&] {
    std::vector<int> waiting;
    for (const auto& [peer, socket] : watches) waiting.push_back(peer);
    return list_ranks(waiting);
  }());

  // Step 2: reports, until every watched rank has reported or is gone.
  for (;;) {
    take_reports();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& [peer, socket] : watchers_) {
        if (peer >= rank_) continue;
        const Error conflict(
            Status::kPeerLost,
            fmt::format("kolo_comm_shrink: ranks {} and {} both coordinate (rank {} could not "
                        "reach rank {}); no communicator is formed: check the network between "
                        "them",
                        peer, rank_, rank_, peer));
        send_abort(socket, conflict);
        throw fail(conflict);
      }
    }
    if (watches.empty() || until.expired()) break;
    std::vector<pollfd> entries;
    for (const auto& [peer, socket] : watches) entries.push_back({socket.fd(), POLLIN, 0});
    for (const auto& [peer, socket] : followers) entries.push_back({socket.fd(), POLLIN, 0});
    if (::poll(entries.data(), entries.size(), std::min(until.remaining_ms(), 20)) < 0 &&
        errno != EINTR) {
      throw fail(Error(Status::kSystem,
                       fmt::format("kolo_comm_shrink: poll: {}", std::strerror(errno))));
    }
    for (auto it = watches.begin(); it != watches.end();) {
      const Peek seen = peek(it->second);
      if (seen == Peek::kSpoke) {
        // The watched rank says why it will not take part: it coordinates too, or committed.
        Message message = recv_word(it->second, Deadline(kHandshakeSeconds), it->first);
        throw fail(message.word == lifeline_wire::kAbort
                       ? lifeline_wire::abort_error(message, it->first)
                       : Error(Status::kMismatch,
                               fmt::format("kolo_comm_shrink: rank {} spoke on a watch",
                                           it->first)));
      }
      if (seen == Peek::kClosed) {
        log::info("kolo_comm_shrink: rank {} was lost before it reported", it->first);
        gone[it->first] = true;
        it = watches.erase(it);
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
  }
  if (!watches.empty()) {
    std::vector<int> late;
    for (const auto& [peer, socket] : watches) late.push_back(peer);
    log::warn("kolo_comm_shrink: rank(s) {} live but did not call kolo_comm_shrink within {:.3g} "
              "s: they are left out",
              list_ranks(late), kReportTimeouts * timeout_s_);
    watches.clear();  // when they come, they are turned away (Lifeline::serve)
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
    const std::vector<uint8_t> payload = lifeline_wire::encode(decision);
    std::vector<int> lost;
    for (auto& [peer, socket] : followers) {
      try {
        send_word(socket, lifeline_wire::kDecision, 0, payload, Deadline(kHandshakeSeconds));
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
          if (built.word != lifeline_wire::kBuilt) {
            throw Error(Status::kMismatch,
                        fmt::format("kolo_comm_shrink: rank {} answered out of turn", peer));
          }
          Error result = lifeline_wire::built_result(built, peer);
          if (result.status() != Status::kSuccess && !failure) failure.emplace(result);
        } catch (const Error& error) {
          if (error.status() != Status::kPeerLost && error.status() != Status::kTimeout) {
            throw fail(error);
          }
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
    if (failure) throw fail(*failure);
    for (auto& [peer, socket] : followers) {
      try {
        send_word(socket, lifeline_wire::kCommit, 0, {}, Deadline(kHandshakeSeconds));
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

// Growing a communicator: its members and new processes form a larger one together
// (kolo_comm_invite, kolo_comm_grow, and kolo_comm_init with KOLO_INVITATION; capi/kolo.h states
// the contract). The world's store and its host play no part: the communicator's own rank 0
// coordinates and serves the growth's store, which becomes the new communicator's.
//
//   1. Invitation (rank 0, Communicator::invite): rank 0 starts a store on the host it listens on
//      (or keeps the one it started for an earlier invitation), draws a random 64-bit token and
//      marks the token open there. The text "kolo-grow-1:<token>:<host:port>" is all a newcomer
//      needs besides the job secret, which every connection to that store proves. A later
//      invitation marks the earlier token replaced.
//   2. Newcomers (kolo_comm_init with KOLO_INVITATION, Communicator::join_growth) connect to that
//      store, check that the token is open, take an arrival number (an atomic add) and publish
//      their host identity and process id under it, then wait for the decision.
//   3. Members (Communicator::grow): one allgather on the old communicator of every member's new
//      size and of rank 0's token and store, so that every member sees the same disagreement
//      (KOLO_ERR_MISMATCH, nothing changed: the communicator stays usable) or the same go-ahead.
//      Then the old communicator is broken on every member (a collective or named operation still
//      pending on it fails with KOLO_ERR_CANCELLED), and each member publishes its host identity.
//   4. Decision (rank 0): it waits, bounded by KOLO_TIMEOUT, for every member and for the first
//      new_size - size arrivals, closes the token (later arrivals and later uses of the invitation
//      are refused as used), orders the newcomers by (host identity, process id) after the
//      members, numbers the hosts, draws a fresh context and publishes the decision, or the error
//      that ends the growth (too few newcomers; one whose KOLO_ALLREDUCE differs from rank 0's).
//   5. Build: every rank of the new communicator connects (the constructor of split and shrink,
//      through the growth's store) and publishes whether it could; every rank then reads every
//      rank's outcome, so that all return the new communicator or all fail, each naming the
//      first rank that could not connect. A rank lost meanwhile (a newcomer killed while joining)
//      fails the others' connections or the wait for its outcome, both bounded by KOLO_TIMEOUT.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <sstream>

#include "bootstrap/store.hpp"
#include "comm/communicator.hpp"
#include "comm/connect.hpp"
#include "comm/lifeline.hpp"
#include "core/host.hpp"
#include "core/log.hpp"
#include "ring/algorithms.hpp"
#include "ring/ring.hpp"
#include "transport/transport.hpp"

namespace kolo {

// Rank 0's invitation: the store the growth meets at (shared with the new communicator once it
// exists) and the token that the invitation names.
struct GrowthOffer {
  std::shared_ptr<StoreServer> server;
  std::string address;  // the server's "host:port"
  uint64_t token = 0;
  bool used = false;  // a kolo_comm_grow took it (rank 0's, under the communicator's mutex_)
};

namespace {

constexpr const char* kInvitationPrefix = "kolo-grow-1:";
constexpr size_t kMaxAddressBytes = 96;  // what the members' exchange carries (GrowRecord)
constexpr int kMaxGrowSize = 1 << 20;
// How many timeouts a rank other than rank 0 waits for the decision: rank 0 may wait one for the
// newcomers first.
constexpr double kDecisionTimeouts = 2.0;
// The token's state in the growth's store, an integer so that a newcomer reads it without waiting.
constexpr int64_t kOpen = 1;
constexpr int64_t kClosed = 2;    // its growth has begun, or failed: the invitation is used
constexpr int64_t kReplaced = 3;  // rank 0 made a newer invitation

struct Invitation {
  uint64_t token = 0;
  std::string address;
};

std::string format_invitation(uint64_t token, const std::string& address) {
  return fmt::format("{}{:016x}:{}", kInvitationPrefix, token, address);
}

Invitation parse_invitation(const std::string& text) {
  auto refuse = [&]() -> Invitation {
    throw Error(Status::kConfig,
                fmt::format("kolo_comm_init: KOLO_INVITATION='{}' is no invitation of "
                            "kolo_comm_invite: expected {}<16 hex digits>:<host:port>",
                            text.substr(0, 200), kInvitationPrefix));
  };
  const size_t prefix = std::strlen(kInvitationPrefix);
  if (text.compare(0, prefix, kInvitationPrefix) != 0 || text.size() < prefix + 18 ||
      text[prefix + 16] != ':') {
    return refuse();
  }
  Invitation invitation;
  for (size_t i = prefix; i < prefix + 16; ++i) {
    const char c = text[i];
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0) return refuse();
    invitation.token = invitation.token << 4 | static_cast<uint64_t>(digit);
  }
  invitation.address = text.substr(prefix + 17);
  if (invitation.token == 0 || invitation.address.size() > kMaxAddressBytes) return refuse();
  return invitation;
}

std::string growth_key(uint64_t token, const std::string& name) {
  return fmt::format("grow/{:016x}/{}", token, name);
}

uint64_t random_token() {
  std::random_device device;
  uint64_t token = 0;
  while (token == 0) token = (uint64_t{device()} << 32) ^ device();
  return token;
}

uint64_t fresh_context() {
  uint64_t context = 0;
  while (context <= 1) context = random_token();
  return context & ~(uint64_t{1} << 63);  // the top bit is a fusion engine's (communicator.cpp)
}

// What every member sends in the exchange of step 3; only rank 0's token and store count.
struct GrowRecord {
  int64_t new_size = 0;
  uint64_t token = 0;  // 0: no invitation
  char address[kMaxAddressBytes] = {};
};
static_assert(sizeof(GrowRecord) == 112);

// What every member and newcomer publishes about itself in the growth's store: its
// KOLO_ALLREDUCE (the schedules follow from it, so it must agree, as at a job's start), its
// process id (the newcomers' order) and its host identity (core/host.hpp), one a line.
struct Arrival {
  std::string allreduce;
  int64_t pid = 0;
  std::string host;
};

std::string encode_arrival(const Config& config) {
  return fmt::format("{}\n{}\n{}", config.allreduce, static_cast<int64_t>(::getpid()),
                     host_identity(config));
}

Arrival decode_arrival(const std::string& text) {
  Arrival arrival;
  const size_t first = text.find('\n');
  const size_t second = first == std::string::npos ? first : text.find('\n', first + 1);
  if (second == std::string::npos) {
    throw Error(Status::kInternal, "kolo_comm_grow: a malformed arrival in the growth's store");
  }
  arrival.allreduce = text.substr(0, first);
  arrival.pid = std::strtoll(text.c_str() + first + 1, nullptr, 10);
  arrival.host = text.substr(second + 1);
  return arrival;
}

// Rank 0's decision, as text in the growth's store:
//   "ok <context hex> <size> <members>\n" then one line per newcomer rank, "<arrival>", then one
//   line per rank, "<host number>";
//   or "error <status> <message>".
struct Decision {
  uint64_t context = 0;
  int size = 0;
  int members = 0;
  std::vector<int64_t> arrivals;  // the newcomers' arrival numbers, in rank order
  std::vector<int> host_of;       // every rank's host number
};

std::string encode_decision(const Decision& decision) {
  std::string text =
      fmt::format("ok {:x} {} {}\n", decision.context, decision.size, decision.members);
  for (int64_t arrival : decision.arrivals) text += fmt::format("{}\n", arrival);
  for (int host : decision.host_of) text += fmt::format("{}\n", host);
  return text;
}

std::string encode_failure(const Error& error) {
  return fmt::format("error {} {}", static_cast<int>(error.status()), error.what());
}

// The decision, or the error it carries. The store is the job's (authenticated), yet a value that
// does not parse is an error, never a crash.
Decision decode_decision(const std::string& text, const char* call) {
  std::istringstream in(text);
  std::string word;
  in >> word;
  if (word == "error") {
    int64_t value = 0;
    in >> value;
    std::string message;
    std::getline(in, message);
    if (!message.empty() && message.front() == ' ') message.erase(0, 1);
    Status status = Status::kInternal;
    if (!status_from_wire(value, status) || status == Status::kSuccess) status = Status::kInternal;
    throw Error(status, message);
  }
  Decision decision;
  bool good = word == "ok" && static_cast<bool>(in >> std::hex >> decision.context >> std::dec >>
                                                decision.size >> decision.members);
  good = good && decision.members >= 1 && decision.members < decision.size &&
         decision.size <= kMaxGrowSize;
  if (good) {
    decision.arrivals.resize(static_cast<size_t>(decision.size - decision.members));
    decision.host_of.resize(static_cast<size_t>(decision.size));
    for (int64_t& arrival : decision.arrivals) good = good && (in >> arrival) && arrival >= 0;
    for (int& host : decision.host_of) {
      good = good && (in >> host) && host >= 0 && host < decision.size;
    }
  }
  if (!good) {
    throw Error(Status::kInternal,
                fmt::format("{}: the growth's decision in the store is malformed", call));
  }
  return decision;
}

// This rank's configuration in the new communicator: the given one with the growth's rank, size,
// store, and local rank and size from the host numbers.
Config member_config(Config config, const Decision& decision, int rank,
                     const std::string& address) {
  config.rank = rank;
  config.size = decision.size;
  config.addr = address;
  config.store_generation = 0;  // the growth's store admits clients of any communicator
  config.invitation.clear();
  config.local_rank = 0;
  config.local_size = 0;
  for (int other = 0; other < decision.size; ++other) {
    if (decision.host_of[other] != decision.host_of[rank]) continue;
    if (other < rank) ++config.local_rank;
    ++config.local_size;
  }
  return config;
}

// Step 5, after this rank tried to connect (failure: why it could not): publishes the outcome,
// reads every rank's, and throws the first failure, this rank's own first.
void settle_growth(StoreClient& store, uint64_t token, int rank, int size,
                   const std::optional<Error>& failure, const char* call) {
  store.set_string(growth_key(token, fmt::format("built/{}", rank)),
                   failure ? encode_failure(*failure) : std::string("ok"));
  if (failure) throw *failure;
  for (int other = 0; other < size; ++other) {
    std::string outcome;
    try {
      outcome = store.get_string(growth_key(token, fmt::format("built/{}", other)));
    } catch (const Error& error) {
      throw Error(error.status(),
                  fmt::format("{}: rank {} of the new communicator did not say whether it "
                              "connected (lost while joining?): {}",
                              call, other, error.what()));
    }
    if (outcome == "ok") continue;
    try {
      decode_decision(outcome, call);
    } catch (const Error& error) {
      throw Error(error.status(), fmt::format("{}: rank {} of the new communicator could not "
                                              "connect, so no rank keeps it: {}",
                                              call, other, error.what()));
    }
  }
}

}  // namespace

std::string Communicator::invite() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (broken_) throw *broken_;
  if (config_.rank != 0) {
    throw Error(Status::kInvalidArgument,
                fmt::format("kolo_comm_invite: only rank 0 of the communicator makes invitations "
                            "(it serves the growth's store); this is rank {}: pass rank 0's "
                            "invitation to the newcomers",
                            config_.rank));
  }
  auto offer = std::make_shared<GrowthOffer>();
  if (offer_) {
    offer->server = offer_->server;
    offer->address = offer_->address;
  } else {
    StoreLimits limits = store_limits(config_);
    limits.generation = 0;  // newcomers and members of any communicator meet there
    offer->server =
        std::make_shared<StoreServer>(net::Endpoint{lifeline_->host(), 0}, config_.secret, limits);
    offer->address = offer->server->endpoint().to_string();
  }
  if (offer->address.size() > kMaxAddressBytes) {
    throw Error(Status::kSystem, fmt::format("kolo_comm_invite: the store's address {} is longer "
                                             "than {} bytes",
                                             offer->address, kMaxAddressBytes));
  }
  offer->token = random_token();
  Config at_store = config_;
  at_store.addr = offer->address;
  at_store.store_generation = 0;
  std::unique_ptr<StoreClient> store = open_store(at_store);
  if (offer_ && !offer_->used) store->add(growth_key(offer_->token, "state"), kReplaced - kOpen);
  store->add(growth_key(offer->token, "state"), kOpen);
  offer_ = offer;
  log::info(
      "kolo_comm_invite: communicator {:x} invites newcomers through the store at {} "
      "(token {:016x})",
      context_, offer->address, offer->token);
  return format_invitation(offer->token, offer->address);
}

std::unique_ptr<Communicator> Communicator::grow(int new_size) {
  const int n = size();
  if (new_size <= n || new_size > kMaxGrowSize) {
    throw Error(Status::kInvalidArgument,
                fmt::format("kolo_comm_grow: new_size {} must be larger than the communicator's "
                            "size {} and at most {}",
                            new_size, n, kMaxGrowSize));
  }
  std::shared_ptr<GrowthOffer> offer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (offer_ && !offer_->used) offer = offer_;
    if (offer) offer->used = true;  // one growth per invitation, whatever its outcome
  }
  GrowRecord mine;
  mine.new_size = new_size;
  if (offer) {
    mine.token = offer->token;
    std::memcpy(mine.address, offer->address.data(), offer->address.size());
  }
  std::vector<GrowRecord> everyone(static_cast<size_t>(n));
  OpDescriptor descriptor;
  descriptor.collective = Collective::kGrow;
  descriptor.dtype = DataType::kUInt8;
  descriptor.count = sizeof(GrowRecord);
  descriptor.algorithm = allgather_algorithm(sizeof(GrowRecord) * n, n);

  // Rank 0 tells the newcomers waiting at its store why the growth will not happen.
  auto tell_newcomers = [&](const Error& error) {
    if (!offer) return;
    try {
      Config at_store = config_;
      at_store.addr = offer->address;
      at_store.store_generation = 0;
      at_store.timeout_s = std::min(config_.timeout_s, 5.0);
      std::unique_ptr<StoreClient> store = open_store(at_store);
      store->set_string(growth_key(offer->token, "decision"), encode_failure(error));
      store->add(growth_key(offer->token, "state"), kClosed - kOpen);
    } catch (const Error& failure) {
      log::warn("kolo_comm_grow: could not tell the newcomers that the growth failed: {}",
                failure.what());
    }
  };

  try {
    run_collective(descriptor, [&](const OpDescriptor& exchange) {
      allgather_blocks(*ring_, exchange, &mine, everyone.data(),
                       Blocks::equal(sizeof(GrowRecord), n));
    });
  } catch (const Error& error) {
    if (config_.rank == 0) tell_newcomers(error);
    throw;
  }
  // Every member holds the same records, so every member finds the same problem, and returns it
  // without breaking the communicator: nothing was changed yet.
  std::optional<Error> problem;
  for (int r = 1; r < n && !problem; ++r) {
    if (everyone[r].new_size != everyone[0].new_size) {
      problem.emplace(Status::kMismatch,
                      fmt::format("kolo_comm_grow: the members disagree on the new size: rank 0 "
                                  "asked for {} ranks, rank {} for {}; nothing changed, and the "
                                  "invitation is used up",
                                  everyone[0].new_size, r, everyone[r].new_size));
    }
  }
  if (!problem && everyone[0].token == 0) {
    problem.emplace(Status::kInvalidArgument,
                    "kolo_comm_grow: rank 0 has made no invitation (kolo_comm_invite) for this "
                    "growth; nothing changed");
  }
  const std::string address(everyone[0].address,
                            strnlen(everyone[0].address, sizeof everyone[0].address));
  const uint64_t token = everyone[0].token;
  if (problem) {
    if (config_.rank == 0) tell_newcomers(*problem);
    throw *problem;
  }

  // Step 3's end: the old communicator is done on every member. Each member breaks its own: all
  // of them are past the exchange (no collective of theirs waits on comm), and aborting the
  // transport here would reach a member still reading the exchange's last bytes.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_) {
      broken_.emplace(Status::kCancelled,
                      fmt::format("communicator {:x} grew to {} ranks (kolo_comm_grow): use the "
                                  "new communicator",
                                  context_, new_size));
    }
    tell_fusion_engine(*broken_);
  }

  const auto started = Clock::now();
  Config at_store = config_;
  at_store.addr = address;
  at_store.store_generation = 0;
  // Rank 0 waits up to the timeout for the newcomers, then decides: the others wait for the
  // decision longer, so that they read its reason rather than time out with it.
  if (config_.rank != 0) at_store.timeout_s = kDecisionTimeouts * config_.timeout_s;
  std::unique_ptr<StoreClient> store;
  try {
    store = open_store(at_store);
  } catch (const Error& error) {
    throw Error(error.status(), fmt::format("kolo_comm_grow: rank {} could not reach the "
                                            "growth's store at {}, which rank 0 serves: {}",
                                            config_.rank, address, error.what()));
  }
  store->set_string(growth_key(token, fmt::format("member/{}", config_.rank)),
                    encode_arrival(config_));

  // Step 4, on rank 0.
  if (config_.rank == 0) {
    const int newcomers = new_size - n;
    std::string text;
    try {
      std::vector<std::string> keys;
      for (int r = 0; r < n; ++r) keys.push_back(growth_key(token, fmt::format("member/{}", r)));
      for (int i = 0; i < newcomers; ++i) {
        keys.push_back(growth_key(token, fmt::format("newcomer/{}", i)));
      }
      try {
        store->wait(keys);
      } catch (const Error& error) {
        if (error.status() != Status::kTimeout) throw;
        const int64_t arrived = store->add(growth_key(token, "arrivals"), 0);
        throw Error(
            Status::kTimeout,
            fmt::format("kolo_comm_grow: {} of the {} newcomer(s) arrived within {:g} s "
                        "(KOLO_TIMEOUT) with the invitation; no communicator was formed",
                        std::min<int64_t>(arrived, newcomers), newcomers, config_.timeout_s));
      }
      store->add(growth_key(token, "state"), kClosed - kOpen);
      auto arrival_of = [&](const std::string& key, const std::string& name) {
        Arrival arrival = decode_arrival(store->get_string(growth_key(token, key)));
        if (arrival.allreduce != config_.allreduce) {
          throw Error(Status::kConfig,
                      fmt::format("kolo_comm_grow: the {} (process {}) has KOLO_ALLREDUCE={} and "
                                  "rank 0 has {}: every rank must choose the same schedules; no "
                                  "communicator was formed",
                                  name, arrival.pid, arrival.allreduce, config_.allreduce));
        }
        return arrival;
      };
      struct Newcomer {
        Arrival arrival;
        int64_t index = 0;  // its arrival number
      };
      std::vector<Newcomer> joining;
      for (int i = 0; i < newcomers; ++i) {
        joining.push_back(
            Newcomer{arrival_of(fmt::format("newcomer/{}", i), fmt::format("newcomer {}", i)), i});
      }
      std::stable_sort(joining.begin(), joining.end(), [](const Newcomer& a, const Newcomer& b) {
        return a.arrival.host != b.arrival.host ? a.arrival.host < b.arrival.host
                                                : a.arrival.pid < b.arrival.pid;
      });
      Decision decision;
      decision.context = fresh_context();
      decision.size = new_size;
      decision.members = n;
      std::map<std::string, int> host_number;
      auto number_host = [&](const std::string& host) {
        return host_number.emplace(host, static_cast<int>(host_number.size())).first->second;
      };
      for (int r = 0; r < n; ++r) {
        decision.host_of.push_back(number_host(
            arrival_of(fmt::format("member/{}", r), fmt::format("member rank {}", r)).host));
      }
      for (const Newcomer& newcomer : joining) {
        decision.arrivals.push_back(newcomer.index);
        decision.host_of.push_back(number_host(newcomer.arrival.host));
      }
      text = encode_decision(decision);
      log::info(
          "kolo_comm_grow: rank 0 decided: {} member(s) and newcomer arrival(s) {} form "
          "communicator {:x} of {} ranks",
          n, fmt::join(decision.arrivals, ", "), decision.context, new_size);
    } catch (const Error& error) {
      text = encode_failure(error);
    }
    store->set_string(growth_key(token, "decision"), text);
  }

  const Decision decision =
      decode_decision(store->get_string(growth_key(token, "decision")), "kolo_comm_grow");
  std::shared_ptr<StoreServer> server = config_.rank == 0 ? offer->server : nullptr;
  std::unique_ptr<Communicator> member;
  std::optional<Error> failure;
  try {
    member.reset(new Communicator(member_config(config_, decision, config_.rank, address), server,
                                  decision.context, decision.host_of));
  } catch (const Error& error) {
    failure.emplace(error.status(), fmt::format("kolo_comm_grow: rank {} could not connect the "
                                                "new communicator: {}",
                                                config_.rank, error.what()));
  } catch (const std::exception& error) {
    failure.emplace(Status::kSystem, fmt::format("kolo_comm_grow: rank {} could not connect the "
                                                 "new communicator: {}",
                                                 config_.rank, error.what()));
  }
  settle_growth(*store, token, config_.rank, new_size, failure, "kolo_comm_grow");
  log::info("kolo_comm_grow: rank {} of {} is rank {} of {} in communicator {:x} after {:.3f} s",
            config_.rank, n, member->rank(), member->size(), decision.context,
            std::chrono::duration<double>(Clock::now() - started).count());
  return member;
}

void Communicator::join_growth() {
  const Invitation invitation = parse_invitation(config_.invitation);
  Config at_store = config_;
  at_store.addr = invitation.address;
  at_store.store_generation = 0;
  at_store.rank = -1;
  at_store.timeout_s = kDecisionTimeouts * config_.timeout_s;  // as the members' (grow())
  std::unique_ptr<StoreClient> store;
  int64_t state = 0;
  try {
    store = open_store(at_store);
    state = store->add(growth_key(invitation.token, "state"), 0);
  } catch (const Error& error) {
    throw Error(error.status(),
                fmt::format("kolo_comm_init: could not join the growth of KOLO_INVITATION at {}: "
                            "{} (is the invitation current, and KOLO_SECRET the job's?)",
                            invitation.address, error.what()));
  }
  if (state == kClosed) {
    // The decision is there (or comes at once): a failure explains the growth's end better.
    try {
      decode_decision(store->get_string(growth_key(invitation.token, "decision")),
                      "kolo_comm_init");
    } catch (const Error& error) {
      throw Error(error.status(), fmt::format("kolo_comm_init: the growth of KOLO_INVITATION "
                                              "failed: {}",
                                              error.what()));
    }
  }
  if (state != kOpen) {
    throw Error(Status::kConfig,
                state == 0 ? fmt::format("kolo_comm_init: the store at {} knows no growth {:016x}: "
                                         "KOLO_INVITATION is forged, mistyped or from another "
                                         "communicator",
                                         invitation.address, invitation.token)
                : state == kClosed
                    ? fmt::format("kolo_comm_init: KOLO_INVITATION is stale: its growth ({:016x}) "
                                  "has already taken place or failed; ask rank 0 for a new "
                                  "invitation (kolo_comm_invite)",
                                  invitation.token)
                    : fmt::format("kolo_comm_init: KOLO_INVITATION is stale: rank 0 replaced it "
                                  "with a newer invitation (kolo_comm_invite)"));
  }
  const int64_t arrival = store->add(growth_key(invitation.token, "arrivals"), 1) - 1;
  store->set_string(growth_key(invitation.token, fmt::format("newcomer/{}", arrival)),
                    encode_arrival(config_));
  log::info("kolo_comm_init: newcomer {} of growth {:016x} at {}; waiting for the members", arrival,
            invitation.token, invitation.address);

  std::string text;
  try {
    text = store->get_string(growth_key(invitation.token, "decision"));
  } catch (const Error& error) {
    throw Error(error.status(),
                fmt::format("kolo_comm_init: the members did not decide on the growth of "
                            "KOLO_INVITATION (kolo_comm_grow) in time: {}",
                            error.what()));
  }
  Decision decision;
  try {
    decision = decode_decision(text, "kolo_comm_init");
  } catch (const Error& error) {
    throw Error(
        error.status(),
        fmt::format("kolo_comm_init: the growth of KOLO_INVITATION failed: {}", error.what()));
  }
  const auto found = std::find(decision.arrivals.begin(), decision.arrivals.end(), arrival);
  if (found == decision.arrivals.end()) {
    throw Error(Status::kConfig,
                fmt::format("kolo_comm_init: KOLO_INVITATION is used up: its growth took {} "
                            "newcomer(s), and this process came later (arrival {})",
                            decision.arrivals.size(), arrival + 1));
  }
  const int rank = decision.members + static_cast<int>(found - decision.arrivals.begin());
  config_ = member_config(config_, decision, rank, invitation.address);
  log::set_rank(rank);
  context_ = decision.context;
  host_of_ = decision.host_of;
  node_count_ = HostMap(host_of_).shape().hosts;
  std::optional<Error> failure;
  try {
    connect_members();  // as the members do in their constructor (comm/split.cpp)
  } catch (const Error& error) {
    failure.emplace(error.status(), fmt::format("kolo_comm_init: newcomer rank {} could not "
                                                "connect the grown communicator: {}",
                                                rank, error.what()));
  } catch (const std::exception& error) {
    failure.emplace(Status::kSystem, fmt::format("kolo_comm_init: newcomer rank {} could not "
                                                 "connect the grown communicator: {}",
                                                 rank, error.what()));
  }
  settle_growth(*store, invitation.token, rank, decision.size, failure, "kolo_comm_init");
  log::info("kolo_comm_init: joined communicator {:x} as rank {} of {} (local rank {} of {})",
            context_, config_.rank, config_.size, config_.local_rank, config_.local_size);
}

}  // namespace kolo

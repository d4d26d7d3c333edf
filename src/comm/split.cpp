// Communicator::split: ranks that pass the same colour form a new communicator, ordered by key
// (MPI_Comm_split, ncclCommSplit).
//
// The split is one collective call on the parent, under the parent's lock (so another thread's
// call on the parent cannot slip between its steps), in four steps:
//
//   1. Exchange: an allgather on the parent of every rank's (colour, key, host), 16 bytes a rank.
//   2. Members: the ranks with this rank's colour, ordered by (key, parent rank); the position in
//      that order is the new rank. Local rank and size, and the node count, come from the hosts.
//   3. Connect: each member opens its own connection to the rendezvous store (a store client is
//      not thread-safe, and the new communicator may be used from another thread at the same time
//      as the parent) and builds a new transport among the members. The transport's store keys and
//      connection hellos carry a context: a 64-bit mix of the parent's context, the split's
//      sequence number on the parent (the same on every rank, the split being collective) and the
//      colour — different for every communicator split from this parent, and (with overwhelming
//      probability) from every other communicator in the job.
//   4. Outcome: an allreduce (max) on the parent of every rank's status, so that either every
//      rank gets its new communicator, or every rank reports the failure (naming a rank that
//      failed). This also keeps every rank in the call until every member is done with the store,
//      after which each member erases the keys it wrote there to connect. Exactly those: keys
//      under the new communicator's prefix that are written later (a GPU set-up's, by a member
//      that has already returned) are not the split's to erase.
//
// Because each communicator has its own transport (its own sockets and progress), its own lock
// and its own sequence numbers, operations on a parent, its children and their siblings never mix,
// from any number of threads. The new communicator shares nothing with the parent but the store
// server, which rank 0's process keeps (shared ownership) until its last communicator is destroyed:
// destroying the parent first leaves the children working, and splitting them further works as
// long as the process of the world's rank 0 still holds a communicator.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "bootstrap/store.hpp"
#include "comm/report.hpp"
#include "comm/communicator.hpp"
#include "comm/connect.hpp"
#include "comm/lifeline.hpp"
#include "core/host.hpp"
#include "core/log.hpp"
#include "ring/algorithms.hpp"
#include "ring/ring.hpp"
#include "transport/transport.hpp"

namespace kolo {
namespace {

struct MemberInfo {
  int32_t color = -1;
  int32_t key = 0;
  uint64_t host = 0;  // a hash of the host identity (core/host.hpp)
};
static_assert(sizeof(MemberInfo) == 16);

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t hash_text(const std::string& text) {
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : text) hash = (hash ^ c) * 0x100000001b3ull;
  return hash;
}

}  // namespace

void Communicator::connect_members() {
  store_ = open_store(config_);
  store_->remember_written_keys();
  const std::string host = listen_host(config_, *store_, context_);
  Links links = connect_links(config_, *store_, context_, Waiter::kApplication, host);
  transport_ = std::move(links.transport);
  ring_ = std::move(links.ring);
  lifeline_ = std::make_shared<Lifeline>(config_, *store_, context_, host);
  connect_keys_ = store_->take_written_keys();
  place_allreduce();
}

Communicator::Communicator(const Config& config, std::shared_ptr<StoreServer> server,
                           uint64_t context, const std::vector<int>& host_of)
    : config_(config), host_of_(host_of), server_(std::move(server)), context_(context) {
  node_count_ = HostMap(host_of_).shape().hosts;
  connect_members();
  log::info("sub-communicator {:x} ready: rank {} of {}, local rank {} of {}, {} node(s)", context_,
            config_.rank, config_.size, config_.local_rank, config_.local_size, node_count_);
  report_on(this);
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  const int n = size();
  const MemberInfo mine{color < 0 ? -1 : color, key, hash_text(host_identity(config_))};
  std::vector<MemberInfo> everyone(static_cast<size_t>(n));
  std::unique_ptr<Communicator> child;
  std::optional<Error> failure;
  int32_t outcome[2] = {0, -1};  // the worst status, and a rank that had it

  OpDescriptor descriptor;
  descriptor.collective = Collective::kSplit;
  descriptor.dtype = DataType::kUInt8;
  descriptor.count = sizeof(MemberInfo);
  descriptor.algorithm = allgather_algorithm(sizeof(MemberInfo) * n, n);
  run_collective(descriptor, [&](const OpDescriptor& exchange) {
    // Under PMIx the world started without a store: world rank 0's process serves it from the
    // first split on (comm/connect.hpp, ReservedStore), whether or not it is a member.
    if (!server_) {
      if (std::shared_ptr<StoreServer> served = serve_reserved_store(config_)) server_ = served;
    }
    const Blocks blocks = Blocks::equal(sizeof(MemberInfo), n);
    allgather_blocks(*ring_, exchange, &mine, everyone.data(), blocks);

    if (mine.color >= 0) {
      std::vector<int> members;
      for (int r = 0; r < n; ++r) {
        if (everyone[r].color == mine.color) members.push_back(r);
      }
      std::stable_sort(members.begin(), members.end(),
                       [&](int a, int b) { return everyone[a].key < everyone[b].key; });
      Config config = config_;
      config.size = static_cast<int>(members.size());
      config.rank = -1;  // found below
      config.local_rank = 0;
      config.local_size = 0;
      std::vector<int> host_of;  // the parent's host number of each member
      for (int position = 0; position < config.size; ++position) {
        const int member = members[position];
        if (member == rank()) config.rank = position;
        if (everyone[member].host == mine.host) {
          if (member != rank() && config.rank < 0) ++config.local_rank;
          ++config.local_size;
        }
        host_of.push_back(host_of_[member]);
      }
      uint64_t context = mix(mix(context_ ^ mix(exchange.sequence)) ^ static_cast<uint32_t>(color));
      if (context <= 1) context += 2;  // 0 is unused, 1 is the world's
      try {
        child.reset(new Communicator(config, server_, context, host_of));
      } catch (const Error& error) {
        failure.emplace(error);
      } catch (const std::exception& error) {
        failure.emplace(Status::kSystem, error.what());
      }
      if (failure) {
        outcome[0] = static_cast<int32_t>(failure->status());
        outcome[1] = rank();
      }
    }

    OpDescriptor report = exchange;
    report.dtype = DataType::kInt32;
    report.op = ReduceOp::kMax;
    report.count = 2;
    run_allreduce(*ring_, report, outcome, outcome);
  });

  if (failure) throw Error(failure->status(), fmt::format("split: {}", failure->what()));
  if (outcome[0] != 0) {
    Status status = Status::kInternal;  // what a number that is no status becomes
    status_from_wire(outcome[0], status);
    throw Error(status,
                fmt::format("split: rank {} of the parent communicator could not join its new "
                            "communicator, so no rank gets one (see that rank's error)",
                            outcome[1]));
  }
  // Every member is past its connect (the outcome above waited for all of them), so no rank reads
  // the keys written to connect again: each member erases its own, so that a job that splits
  // again and again does not fill the store. Keys written later (a GPU set-up) stay.
  if (child) {
    try {
      const uint64_t erased = child->store_->erase(child->connect_keys_);
      log::info("split: erased the {} store key(s) rank {} wrote to connect communicator {:x}",
                erased, child->rank(), child->context_);
    } catch (const Error& error) {
      log::warn("split: could not erase the store keys rank {} wrote to connect communicator "
                "{:x}: {}",
                child->rank(), child->context_, error.what());
    }
    child->connect_keys_.clear();
  }
  return child;
}

}  // namespace kolo

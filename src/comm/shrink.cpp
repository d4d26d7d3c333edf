// Communicator::shrink: the survivors of a lost rank form a new communicator (ULFM's
// MPI_Comm_shrink, ncclCommShrink). capi/kolo.h states the contract; comm/lifeline.hpp is how the
// survivors agree. Here, the two ends of it:
//
//   1. Break this communicator on every rank: a rank still waiting in a collective on it (it
//      waits for a peer that is gone, or for one that is here) fails at once and comes to
//      shrink too, instead of at its timeout; the fusion engine fails its pending requests.
//   2. Agree, and build the member the coordinator decides on: the parent's configuration with
//      the new rank and size, local rank and size from the members' hosts, and the new store's
//      address; the coordinator's process serves that store (it is the new rank 0) for as long as
//      it holds a communicator descended from it, as rank 0's process does for the job's.
//   3. Keep this communicator's lifeline listening for as long as the new one lives: a survivor
//      that comes too late then waits at its coordinator's and gets an error, instead of finding
//      every lower rank's listener closed and forming a communicator of its own.
#include <fmt/format.h>

#include <algorithm>

#include "bootstrap/store.hpp"
#include "comm/communicator.hpp"
#include "comm/connect.hpp"
#include "comm/lifeline.hpp"
#include "core/log.hpp"
#include "transport/transport.hpp"

namespace kolo {

std::unique_ptr<Communicator> Communicator::shrink() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!broken_) {
    broken_.emplace(Status::kPeerLost,
                    fmt::format("communicator {:x} was shrunk (kolo_comm_shrink by rank {}): use "
                                "the new communicator",
                                context_, config_.rank));
    transport_->abort(*broken_);
  }
  tell_fusion_engine(*broken_);

  std::shared_ptr<StoreServer> server;
  std::unique_ptr<Communicator> member;
  Lifeline::Steps steps;
  steps.serve_store = [&] {
    server = std::make_shared<StoreServer>(net::Endpoint{lifeline_->host(), 0}, config_.secret,
                                           store_limits(config_));
    return server->endpoint().to_string();
  };
  steps.build = [&](const ShrinkDecision& decision) {
    member.reset();
    Config config = config_;
    config.addr = decision.store;
    config.size = static_cast<int>(decision.members.size());
    config.local_rank = 0;
    config.local_size = 0;
    std::vector<int> host_of;
    for (int position = 0; position < config.size; ++position) {
      const int old_rank = decision.members[position];
      if (old_rank == config_.rank) config.rank = position;
      if (host_of_[old_rank] == host_of_[config_.rank]) {
        if (old_rank < config_.rank) ++config.local_rank;
        ++config.local_size;
      }
      host_of.push_back(host_of_[old_rank]);
    }
    member.reset(new Communicator(config, server, decision.context, host_of));
  };
  steps.discard = [&] { member.reset(); };

  const auto started = Clock::now();
  const ShrinkDecision decision = lifeline_->agree(steps);
  member->predecessor_ = lifeline_;
  log::info("kolo_comm_shrink: rank {} of {} is rank {} of {} in communicator {:x} after {:.3f} s",
            config_.rank, config_.size, member->rank(), member->size(), decision.context,
            std::chrono::duration<double>(Clock::now() - started).count());
  return member;
}

}  // namespace kolo

// The lifeline: how the survivors of a broken communicator find each other and agree on a new one
// (kolo_comm_shrink: capi/kolo.h states the contract, comm/shrink.cpp builds the communicator).
//
// Every rank of a communicator listens on an address of its own from the moment the communicator
// is created, and learns every peer's then, through the rendezvous store; later, when a rank is
// lost (rank 0 and the store with it, perhaps), the survivors need nothing but these addresses.
// Nobody accepts on the listener until kolo_comm_shrink: a connection waits in the kernel's
// backlog, and is refused at once, or reset, when the process is gone (its listener closed with
// it). So whether rank r still lives is one connection attempt, and a connection held open tells
// the moment it dies.
//
// The agreement:
//   1. Each rank looks for its coordinator: the lowest rank whose listener still takes a
//      connection (itself, if every lower one is gone). A follower proves the job secret over that
//      connection, saying it reports (net/auth.hpp), once the coordinator accepts.
//   2. The coordinator probes every higher rank with a connection that says nothing: refused means
//      gone; taken means alive, and held open, it resets when that process dies. It accepts
//      reports until every rank has reported or is gone, at most twice the timeout from its own
//      call (a survivor may first have to finish another blocking call, bounded by the timeout);
//      ranks alive but silent by then are left out.
//   3. It decides: the members are itself and its followers, in rank order, with a fresh random
//      context and the address of a new rendezvous store that it serves. It sends the decision
//      to every follower, and every member (itself too) builds its communicator and says whether
//      it could.
//   4. All could: it sends the commit and every member returns its communicator. A member lost
//      meanwhile (its connection closed): it decides again without it. Any other failure: every
//      member gets it.
// A follower whose coordinator is lost before deciding starts again at 1 without it; one lost
// after deciding may have committed to others, so the follower returns an error naming it.
// A probe that the prober sees accepted means the probed rank coordinates too (the two could not
// reach each other): both give up with an error rather than form two communicators.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "net/socket.hpp"

namespace kolo {

class StoreClient;

// What a coordinator decided: the members (ranks of the old communicator, in order), the new
// communicator's context, and the address of its rendezvous store.
struct ShrinkDecision {
  std::vector<int> members;
  uint64_t context = 0;
  std::string store;  // "host:port"
};

class Lifeline {
 public:
  // Listens, publishes this rank's address under the communicator's context and reads every
  // peer's. Collective: part of every communicator's construction.
  Lifeline(const Config& config, StoreClient& store, uint64_t context);
  Lifeline(const Lifeline&) = delete;
  Lifeline& operator=(const Lifeline&) = delete;

  // The host this rank listens on (where a coordinator serves the new store).
  const std::string& host() const { return host_; }

  // What the agreement asks of the communicator layer.
  struct Steps {
    std::function<std::string()> serve_store;  // coordinator, once: starts the store, its address
    std::function<void(const ShrinkDecision&)> build;  // this rank's communicator; throws Error
    std::function<void()> discard;                     // forgets what build made
  };
  // Runs the agreement; returns the decision once committed (what build made last is then this
  // rank's communicator), or throws kolo::Error. Any number of times.
  ShrinkDecision agree(const Steps& steps);

 private:
  // Step 1 for this rank: the coordinator's rank, and the connection to it when it is not this
  // rank. Marks ranks found gone.
  int find_coordinator(std::vector<bool>& gone, net::Socket& link);
  ShrinkDecision coordinate(std::vector<bool>& gone, const Steps& steps);
  // Nothing when the coordinator was lost before it decided.
  std::optional<ShrinkDecision> follow(int coordinator, net::Socket& link, const Steps& steps);

  int rank_;
  int size_;
  uint64_t context_;
  std::string secret_;
  double timeout_s_;
  std::string host_;
  net::Socket listener_;
  std::vector<net::Endpoint> addresses_;  // every rank's listener
};

}  // namespace kolo

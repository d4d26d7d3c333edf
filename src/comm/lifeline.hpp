// The lifeline: how the survivors of a broken communicator find each other and agree on a new one
// (kolo_comm_shrink: capi/kolo.h states the contract, comm/shrink.cpp builds the communicator).
//
// Every rank of a communicator listens on an address of its own from the moment the communicator
// is created, and learns every peer's then, through the rendezvous store; later, when a rank is
// lost (rank 0 and the store with it, perhaps), the survivors need nothing but these addresses.
// A thread of the lifeline admits connections on that listener all the time, through a Gate
// (net/gate.hpp): strangers never fill its backlog, and a connection proves the job secret and
// says what it is for before this side answers. So whether rank r still lives is one attempt to
// reach it: admitted means alive; refused, reset or unreachable by its host means gone; anything
// else (no answer, or never admitted by the deadline) is no evidence either way, and the shrink
// fails with an error (call again) rather than leave out a rank that may be alive.
//
// The agreement:
//   1. Each rank looks for its coordinator: the lowest rank it can reach (itself, if every lower
//      one is gone). Its report is that connection: the hello says "report", the coordinator's
//      lifeline thread admits it and keeps it for the agreement, also before the coordinator
//      itself calls kolo_comm_shrink.
//   2. The coordinator watches every higher rank that has not reported yet with a connection that
//      says "watch": the watched rank's thread holds it, so it closes the moment that process
//      dies. It waits until every rank has reported or is gone, at most twice the timeout from its
//      own call (a survivor may first have to finish another blocking call, bounded by the
//      timeout); ranks alive but silent by then are left out, and turned away when they come.
//   3. It decides: the members are itself and its followers, in rank order, with a fresh random
//      context and the address of a new rendezvous store that it serves. It sends the decision
//      to every follower, and every member (itself too) builds its communicator and says whether
//      it could.
//   4. All could: it sends the commit and every member returns its communicator. A member lost
//      meanwhile (its connection closed): it decides again without it. Any other failure: every
//      member gets it.
// A follower whose coordinator closes the connection before deciding looks for its coordinator
// again (the coordinator is then gone, or it reports to it anew); one lost after deciding may have
// committed to others, so the follower returns an error naming it. Once a rank has committed, its
// lifeline turns every later report and watch away with an error that says so.
// Two coordinators cannot both succeed: a coordinator that finds a lower rank watching it (that
// rank coordinates too: the two could not reach each other) aborts both, over the watch.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/lifeline_wire.hpp"
#include "core/config.hpp"
#include "net/gate.hpp"
#include "net/socket.hpp"

namespace kolo {

class StoreClient;

class Lifeline {
 public:
  // Listens on listen_host (the communicator's: listen_host() in comm/connect.hpp), publishes
  // this rank's address under the communicator's context, reads every peer's (one request) and
  // starts the thread that admits connections. Collective: part of every communicator's
  // construction.
  Lifeline(const Config& config, StoreClient& store, uint64_t context,
           const std::string& listen_host);
  // The same without the store, for a group that exchanged its lifeline addresses with its other
  // start-up records (the world communicator under PMIx): `listener` already listens, and
  // `addresses` holds every rank's "host:port" in rank order, this rank's included. Throws
  // kolo::Error(kConfig) naming the rank whose address does not parse. `host` is host() where the
  // listener's own address is not it (a listener on every interface); empty: the listener's.
  Lifeline(const Config& config, uint64_t context, net::Socket listener,
           const std::vector<std::string>& addresses, const std::string& host = {});
  ~Lifeline();
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
  // rank's communicator), or throws kolo::Error. Any number of times until one commits.
  ShrinkDecision agree(const Steps& steps);

 private:
  // The thread: admits through the gate, keeps reports and watches, turns late ones away.
  void serve();
  // Step 1 for this rank: the coordinator's rank, and the connection to it when it is not this
  // rank. Marks ranks found gone; throws when a lower rank gives no evidence either way.
  int find_coordinator(std::vector<bool>& gone, net::Socket& link);
  ShrinkDecision coordinate(std::vector<bool>& gone, const Steps& steps);
  // Nothing when the coordinator closed the connection before it decided.
  std::optional<ShrinkDecision> follow(int coordinator, net::Socket& link, const Steps& steps);
  // The reports admitted since the last call (rank -> connection, blocking).
  std::map<int, net::Socket> take_reports();
  // The agreement is over: committed to `decision` coordinated by `coordinator`, or failed with
  // `failure` (then a later call may agree after all). Reports waiting and watches of other
  // coordinators are turned away with the reason.
  void settle(const Error& failure);
  void settle(const ShrinkDecision& decision, int coordinator);

  int rank_;
  int size_;
  uint64_t context_;
  std::string secret_;
  double timeout_s_;
  // Everything but learning the peers' addresses and starting the thread.
  Lifeline(const Config& config, uint64_t context, net::Socket listener, std::string host);

  std::string host_;
  std::vector<net::Endpoint> addresses_;  // every rank's listener
  std::unique_ptr<net::Gate> gate_;       // the thread's only, once it runs
  net::Socket wake_;                      // an eventfd: the destructor stops the thread

  std::mutex mutex_;
  // Under mutex_:
  bool stop_ = false;
  bool coordinating_ = false;
  std::map<int, net::Socket> reports_;   // admitted reports the agreement has not taken
  std::map<int, net::Socket> watchers_;  // admitted watches of coordinators, held open
  std::optional<int> committed_coordinator_;  // set once this rank committed
  std::string turned_away_;  // why later reports and watches are turned away, once committed

  std::thread thread_;
};

}  // namespace kolo

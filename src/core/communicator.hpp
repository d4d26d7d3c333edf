// A communicator: a group of ranks, their connections, and the collectives they run together.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "core/config.hpp"
#include "core/op_descriptor.hpp"
#include "kolo/dtype.hpp"
#include "kolo/status.hpp"

namespace kolo {

class StoreServer;
class StoreClient;
class Transport;
class Ring;

class Communicator {
 public:
  // Joins the job described by the overrides and the environment (see core/config.hpp): rank 0
  // serves the rendezvous store, every rank publishes its address and connects to every peer.
  // Blocks until all ranks have joined or the timeout passes; throws kolo::Error.
  explicit Communicator(const ConfigOverrides& overrides);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return config_.rank; }
  int size() const { return config_.size; }
  int local_rank() const { return config_.local_rank; }
  int local_size() const { return config_.local_size; }
  int node_count() const { return node_count_; }
  const Config& config() const { return config_; }

  // Collectives. Each validates its arguments first (kolo::Error(kInvalidArgument), nothing sent,
  // the communicator stays usable). Any later failure breaks the communicator: this and every
  // following call throw the same error. Calls from several threads are serialised.
  void allreduce(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype, ReduceOp op,
                 double prescale = 1.0, double postscale = 1.0);
  void broadcast(void* buffer, uint64_t count, DataType dtype, int root);
  void barrier();

 private:
  template <typename Body>
  void run(OpDescriptor op, Body&& body);
  void validate_buffer(const void* buffer, uint64_t count, DataType dtype, const char* name) const;
  void discover_hosts();

  Config config_;
  int node_count_ = 1;
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<StoreClient> store_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Ring> ring_;
  std::mutex mutex_;
  uint64_t sequence_ = 0;
  std::optional<Error> broken_;
};

}  // namespace kolo

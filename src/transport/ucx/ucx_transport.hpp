// UCX transport: UCP tagged messages over whatever UCX finds (shared memory and CMA within a host,
// InfiniBand/RoCE, TCP), with kolo's control channel beside it for failures. Built only where
// libucx-dev is installed (KOLO_HAVE_UCX); nothing outside this folder includes UCX headers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "transport/transport.hpp"

namespace kolo {

std::unique_ptr<Transport> make_ucx_transport(const TransportSettings& settings, StoreClient& store,
                                              int rank, int size, uint64_t context);

// Whether this host has an RDMA port that is up (/sys/class/infiniband/<device>/ports/<n>/state
// reads "4: ACTIVE").
bool has_active_rdma_port();

// What this rank tells the others for KOLO_TRANSPORT=auto: "<1 if it has an active RDMA port,
// else 0> <host>".
std::string ucx_auto_facts(const TransportSettings& settings);

// KOLO_TRANSPORT=auto: whether UCX gives this job a faster path than kolo's TCP transport, namely
// every rank on one host (shared memory) or an active RDMA port on every host. Every rank
// publishes its host and RDMA ports in the store and rank 0 decides for all, so that all ranks
// choose the same transport; where the group exchanged every rank's ucx_auto_facts already
// (TransportSettings::prepared), every rank decides from them alike, without the store. `reason`
// says why, for the log.
bool ucx_is_faster(const TransportSettings& settings, StoreClient& store, int rank, int size,
                   uint64_t context, std::string& reason);

}  // namespace kolo

// Rendezvous through PMIx: under a launcher that runs a PMIx server (Open MPI's mpirun, Slurm's
// `srun --mpi=pmix`, any PMIx-aware resource manager), rank 0's store address travels through the
// launcher instead of being chosen by the user.
//
// When it is used: the launcher exported PMIX_NAMESPACE and PMIX_RANK, and neither KOLO_ADDR (or
// kolo_config_t.addr) nor MASTER_ADDR/MASTER_PORT names an address (core/config.cpp marks
// Config::pmix_rendezvous). The rendezvous store itself stays: rank 0 still serves it, on a port
// the system picks on every interface of its host, because splits, shrink and the lifeline use it
// long after start-up, when a job-wide PMIx fence could no longer complete once a rank is gone.
// PMIx replaces only the choice of address and port.
//
// The exchange, once per communicator made by kolo_comm_init:
//   rank 0   PMIx_Put(PMIX_GLOBAL, "kolo.store.<generation>", "host:port"); PMIx_Commit
//   every    PMIx_Fence over the whole namespace, collecting data, bounded by KOLO_TIMEOUT
//   others   PMIx_Get(rank 0, "kolo.store.<generation>")
// The generation (Config::store_generation) counts the communicators made through PMIx in this
// process; every rank makes them in the same order, so the keys agree without being exchanged.
//
// PMIx_Init runs once per process, at the first such communicator; PMIx_Finalize at exit.
//
// The job secret is not passed through PMIx: Open MPI's daemons forward the collected data
// between hosts over their own unencrypted connections, so a secret sent that way is only as
// private as the network between the hosts. Without KOLO_SECRET or KOLO_SECRET_FILE a job is
// unauthenticated as under any other launcher, and warns so.
//
// In a build without PMIx (meson -Dpmix=disabled, or libpmix-dev missing) the exchange fails with
// KOLO_ERR_UNSUPPORTED naming KOLO_ADDR.
#pragma once

#include <cstdint>
#include <string>

#include "core/config.hpp"

namespace kolo::pmix {

// True when this build can rendezvous through PMIx.
bool built_with_pmix();

// Hands rank 0's store address to every rank: rank 0 passes `own_store_address` ("host:port")
// and gets it back, the other ranks pass "" and get rank 0's. Blocks at most config.timeout_s in
// the fence. Throws kolo::Error: kTimeout when the fence does not complete in time, kPeerLost
// when the server fails it (a process of the job ended), kConfig when PMIx_Init fails, PMIx's
// rank differs from config.rank or rank 0's key is missing, kUnsupported in a build without
// PMIx; each message names PMIx, the rank and KOLO_ADDR.
std::string share_store_address(const Config& config, const std::string& own_store_address);

}  // namespace kolo::pmix

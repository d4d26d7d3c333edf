// Start-up through PMIx: under a launcher that runs a PMIx server (Open MPI's mpirun, Slurm's
// `srun --mpi=pmix`, any PMIx-aware resource manager), the ranks exchange what they need to
// connect through the launcher, and no store serves at start-up.
//
// When it is used: the launcher exported PMIX_NAMESPACE and PMIX_RANK, and neither KOLO_ADDR (or
// kolo_config_t.addr) nor MASTER_ADDR/MASTER_PORT names an address (core/config.cpp marks
// Config::pmix_rendezvous).
//
// The exchange, once per communicator made by kolo_comm_init (comm/communicator.cpp says what a
// record holds): every rank has opened its listeners first, then
//   every    PMIx_Put(PMIX_GLOBAL, "kolo.<generation>", its record); PMIx_Commit
//   every    PMIx_Fence over the whole namespace, collecting data, bounded by KOLO_TIMEOUT
//   every    PMIx_Get(rank r, "kolo.<generation>") for every other rank r, answered locally
// The generation (Config::store_generation) counts the communicators made through PMIx in this
// process; every rank makes them in the same order, so the keys agree without being exchanged.
// Splits, the fusion engine and GPU set-up still meet at a store later, long after start-up, when
// a job-wide fence could no longer complete once a rank is gone: rank 0's record names a port
// that its process has bound and serves from the first time a rank needs it (comm/connect.hpp).
//
// PMIx_Init runs once per process, at the first such communicator; PMIx_Finalize at exit.
//
// The job secret is not passed through PMIx: Open MPI's daemons forward the collected data
// between hosts over their own unencrypted connections, so a secret sent that way is only as
// private as the network between the hosts. Without KOLO_SECRET or KOLO_SECRET_FILE a job is
// unauthenticated as under any other launcher, and warns so.
//
// In a build without PMIx (meson -Dpmix=disabled, or libpmix-dev missing) every call fails with
// KOLO_ERR_UNSUPPORTED naming KOLO_ADDR.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace kolo::pmix {

// True when this build can rendezvous through PMIx.
bool built_with_pmix();

// Every rank's record, in rank order, this rank's (`record`, not empty) included, after one put,
// one commit and one fence. Blocks at most config.timeout_s in the fence. Throws kolo::Error:
// kTimeout when the fence does not complete in time, kPeerLost when the server fails it (a process
// of the job ended), kConfig when PMIx_Init fails, PMIx's rank differs from config.rank or a
// rank's record is missing, kUnsupported in a build without PMIx; each message names PMIx, the
// rank and KOLO_ADDR.
std::vector<std::string> exchange(const Config& config, const std::string& record);

// The host whose route tells this rank which of its addresses the other hosts reach it at, from
// the host names PMIx gives every rank (PMIX_HOSTNAME), without any exchange: rank 0's host; on
// rank 0's host, the first other host of the job; on a job of one host, this one (a loopback
// route, which is right there). Throws kolo::Error(kConfig) naming KOLO_SOCKET_IFNAME when PMIx
// names no host.
std::string route_target(const Config& config);

}  // namespace kolo::pmix

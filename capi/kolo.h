/*
 * kolo.h — the C ABI of kolo, collective communication for data-parallel deep learning.
 *
 * This header is valid C11 and C++. Everything in it is plain C: opaque handles, enums, structs
 * that begin with their own size, and functions that return a kolo_status_t. No C++ type and no
 * exception ever crosses it.
 *
 * Threading: a communicator may be used from several threads; its collectives are serialised
 * internally, so two threads that issue collectives on one communicator must still issue them in
 * the same order on every rank (as with MPI and NCCL). Different communicators are independent.
 * kolo numbers a communicator's collectives in the order threads reach it, and ranks match them
 * by that number: where two threads race, the order may differ from rank to rank, and the ranks
 * then pair different calls. Calls that differ (collective, count, dtype, op, root) fail with
 * KOLO_ERR_MISMATCH; two calls of the same shape cannot be told apart, and each thread may get
 * the other's result. So either order the threads yourself, or give each thread a communicator
 * of its own (kolo_comm_split), or use named operations (matched by name). kolo cannot see
 * whether the application ordered its threads; it logs one WARN per communicator the first time
 * a collective had to wait for another thread's.
 *
 * Blocking: every collective below blocks the calling thread until it has finished on this rank
 * (except the stream-ordered _on_stream calls of "GPU buffers", and the named asynchronous ones),
 * and every wait inside it is bounded by the communicator's timeout (KOLO_TIMEOUT, default 300 s).
 *
 * Failures: argument errors (KOLO_ERR_INVALID_ARGUMENT) are detected before anything is sent and
 * leave the communicator usable. Any other failure (a lost peer, ranks that disagree, a timeout)
 * breaks the communicator: that call and every later collective on it return the same status, and
 * kolo_comm_last_error() says what happened and which rank was involved. A broken communicator can
 * still be destroyed cleanly. After a failed collective the contents of recvbuf are unspecified;
 * sendbuf of an out-of-place call is never written.
 */
#ifndef KOLO_H
#define KOLO_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KOLO_API __attribute__((visibility("default")))
#else
#define KOLO_API
#endif

/* The enums below are int-sized in C. C++ sees them with int as their fixed underlying type, so
 * that any int a caller passes is a value of the enum that kolo can read and refuse when it names
 * no dtype, op or status (without it, reading 256 as a kolo_dtype_t would be undefined). */
#ifdef __cplusplus
#define KOLO_ENUM_INT : int
#else
#define KOLO_ENUM_INT
#endif

/* ---- Versions ------------------------------------------------------------------------------ */

#define KOLO_VERSION_MAJOR 0
#define KOLO_VERSION_MINOR 3
#define KOLO_VERSION_PATCH 0
/* One integer, major * 10000 + minor * 100 + patch, as returned by kolo_version(). */
#define KOLO_VERSION (KOLO_VERSION_MAJOR * 10000 + KOLO_VERSION_MINOR * 100 + KOLO_VERSION_PATCH)
/* The version of the structs in this header; bumped when a field is added. */
#define KOLO_API_VERSION 1

/* The version of the library actually loaded, in the form of KOLO_VERSION. Never fails. */
KOLO_API int kolo_version(void);

/* ---- Status codes -------------------------------------------------------------------------- */

typedef enum kolo_status KOLO_ENUM_INT {
  KOLO_SUCCESS = 0,
  KOLO_ERR_INVALID_ARGUMENT = 1, /* a NULL pointer, unknown dtype/op, bad root, bad config */
  KOLO_ERR_TIMEOUT = 2,          /* a wait ran past the communicator's timeout */
  KOLO_ERR_PEER_LOST = 3,        /* a rank died or its connection broke; the message names it */
  KOLO_ERR_MISMATCH = 4,         /* ranks called different collectives, counts, dtypes or ops */
  KOLO_ERR_INTERNAL = 5,         /* a bug in kolo; please report the message */
  KOLO_ERR_SYSTEM = 6,           /* an operating-system call failed (bind, connect, memory) */
  KOLO_ERR_CONFIG = 7,           /* the environment or config does not describe a usable job */
  KOLO_ERR_UNSUPPORTED = 8,      /* valid, but not available in this build or on this machine */
  KOLO_ERR_CANCELLED = 9         /* a named operation's communicator was destroyed before it ran */
} kolo_status_t;

/* A static English name for a status, such as "KOLO_ERR_PEER_LOST: a peer rank was lost".
 * Never NULL; unknown values give "unknown kolo status". */
KOLO_API const char *kolo_status_string(kolo_status_t status);

/* ---- Data types and reduction operations --------------------------------------------------- */

typedef enum kolo_dtype KOLO_ENUM_INT {
  KOLO_FLOAT32 = 0,
  KOLO_FLOAT64 = 1,
  KOLO_FLOAT16 = 2,  /* IEEE 754 binary16; reductions accumulate in float32 and round once */
  KOLO_BFLOAT16 = 3, /* bfloat16; reductions accumulate in float32 and round once */
  KOLO_INT8 = 4,
  KOLO_UINT8 = 5,
  KOLO_INT32 = 6,
  KOLO_INT64 = 7,
  KOLO_INT16 = 8 /* host memory only: the GPU path has no 16-bit integer type */
} kolo_dtype_t;

typedef enum kolo_op KOLO_ENUM_INT {
  KOLO_SUM = 0,  /* integer sums wrap around (two's complement) */
  KOLO_AVG = 1,  /* sum divided by the number of ranks; integers divide and truncate */
  KOLO_MIN = 2,
  KOLO_MAX = 3,
  KOLO_PROD = 4
} kolo_op_t;

/* The size in bytes of one element of dtype, or 0 for an unknown dtype. */
KOLO_API size_t kolo_dtype_size(kolo_dtype_t dtype);

/* ---- Configuration ------------------------------------------------------------------------- */

#define KOLO_CONFIG_MAGIC 0x6b6f6c6fu /* "kolo" */

/*
 * Start-up settings. Fill it with KOLO_CONFIG_INITIALIZER, then set only the fields you need:
 * every field left at its initial value is taken from the environment (see the README for the
 * KOLO_* variables and the launchers whose variables are understood), and failing that from its
 * documented default. The first three fields let later versions add fields without breaking
 * programs compiled against this one.
 */
typedef struct kolo_config {
  size_t struct_size;    /* sizeof(kolo_config_t), set by the initializer */
  uint32_t magic;        /* KOLO_CONFIG_MAGIC */
  uint32_t api_version;  /* KOLO_API_VERSION */
  int rank;              /* -1: KOLO_RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID or RANK */
  int size;              /* -1: KOLO_SIZE or the launcher's equivalent */
  int local_rank;        /* -1: KOLO_LOCAL_RANK or the launcher's equivalent */
  int local_size;        /* -1: KOLO_LOCAL_SIZE or the launcher's equivalent */
  const char *addr;      /* NULL: KOLO_ADDR, or MASTER_ADDR:MASTER_PORT; "host:port" of the store */
  const char *secret;    /* NULL: KOLO_SECRET; the job secret every connection must prove, "" or
                            at least 16 characters (else KOLO_ERR_CONFIG) */
  double timeout_s;      /* <= 0: KOLO_TIMEOUT (default 300); bound on every wait */
  int tcp_streams;       /* 0: KOLO_TCP_STREAMS (default 1); sockets per peer for data */
  const char *socket_ifname; /* NULL: KOLO_SOCKET_IFNAME; interface to listen on */
  uint64_t segment_bytes;    /* 0: KOLO_SEGMENT_BYTES (default 1 MiB); largest ring segment */
} kolo_config_t;

#define KOLO_CONFIG_INITIALIZER                                                                 \
  {                                                                                             \
    sizeof(kolo_config_t), KOLO_CONFIG_MAGIC, KOLO_API_VERSION, -1, -1, -1, -1, NULL, NULL, 0.0, \
        0, NULL, 0                                                                              \
  }

/* ---- Communicators ------------------------------------------------------------------------- */

/* An opaque handle to a group of ranks that run collectives together. */
typedef struct kolo_comm *kolo_comm_t;

/*
 * Joins the job: reads the configuration (config may be NULL: everything from the environment),
 * meets the other ranks through the rendezvous store that rank 0 serves at the configured address,
 * and connects to every peer. Blocks until all ranks have joined, or the timeout passes. A process
 * that no launcher started (no rank from config, KOLO_RANK or a launcher's variables, and no size
 * or local rank either) is rank 0 of a world of one, said in one INFO line. A process may make
 * communicators at the same address one after another (destroy, then init again, as Horovod's
 * shutdown and init do) when every rank does so in the same order: the Nth communicator made at
 * an address admits only ranks making their Nth there, so a rank that is early waits for rank 0's
 * next store instead of joining the one rank 0 is about to close.
 *
 * On success *comm holds a new communicator that the caller owns and must pass to
 * kolo_comm_destroy(). On failure *comm is set to NULL and the status says why:
 * KOLO_ERR_INVALID_ARGUMENT (comm is NULL, or config has a wrong size or magic),
 * KOLO_ERR_CONFIG (a size without a rank, no size or no address for a rank: the message names
 * the variable to set), KOLO_ERR_TIMEOUT (some rank did not join in time), KOLO_ERR_SYSTEM (a socket could not be
 * opened). The message of a failed init is returned by kolo_comm_last_error(NULL).
 */
KOLO_API kolo_status_t kolo_comm_init(const kolo_config_t *config, kolo_comm_t *comm);

/*
 * Closes every connection and frees the communicator. Does not wait for other ranks: with no
 * named operation running it takes as long as closing sockets. A broken communicator can be
 * destroyed too. Named operations still pending fail with KOLO_ERR_CANCELLED (their callbacks run
 * on this thread); a fused collective that the engine's thread is running when this is called is
 * finished first, so destroy then blocks until it completes or fails, at most the communicator's
 * timeout (KOLO_TIMEOUT), and no buffer of any request is touched once this returns. Request
 * handles stay valid until freed. Passing NULL returns KOLO_ERR_INVALID_ARGUMENT. The handle is
 * invalid afterwards. Calling this while another thread is inside a call on the same
 * communicator (or may still make one) is undefined behaviour: the caller must first make sure
 * that every other thread is done with it, as for free().
 */
KOLO_API kolo_status_t kolo_comm_destroy(kolo_comm_t comm);

/* This process's rank, 0 <= rank < size. KOLO_ERR_INVALID_ARGUMENT if either pointer is NULL. */
KOLO_API kolo_status_t kolo_comm_rank(kolo_comm_t comm, int *rank);
/* The number of ranks in the communicator. */
KOLO_API kolo_status_t kolo_comm_size(kolo_comm_t comm, int *size);
/* This process's rank among the ranks on the same machine. */
KOLO_API kolo_status_t kolo_comm_local_rank(kolo_comm_t comm, int *local_rank);
/* The number of ranks on this machine. */
KOLO_API kolo_status_t kolo_comm_local_size(kolo_comm_t comm, int *local_size);

/*
 * The message of the last failure on comm (or, with comm == NULL, of the last failed
 * kolo_comm_init on this thread), naming the operation and the ranks involved; "" if nothing has
 * failed. The string belongs to kolo; it is this thread's copy, valid until this thread calls
 * kolo_comm_last_error again (for NULL: until its next kolo_comm_init), whatever other threads do
 * on the communicator meanwhile, and after the communicator is destroyed.
 */
KOLO_API const char *kolo_comm_last_error(kolo_comm_t comm);

/* ---- Collectives --------------------------------------------------------------------------- */

/*
 * Reduces count elements of dtype from every rank's sendbuf with op and writes the result to every
 * rank's recvbuf. sendbuf == recvbuf reduces in place. Buffers stay owned by the caller; kolo
 * reads sendbuf and writes recvbuf only during the call. Blocks until done.
 *
 * The result is bitwise identical on every rank and in every run for the same inputs. Uses the
 * ring algorithm (reduce-scatter then allgather, each rank sending 2(N-1)/N of the buffer), or for
 * buffers of at most 32 KiB times N bytes recursive doubling (log2 N exchanges of the buffer).
 *
 * Returns KOLO_ERR_INVALID_ARGUMENT for a NULL comm, a NULL buffer with count > 0, partially
 * overlapping buffers, or an unknown dtype or op (nothing is sent); KOLO_ERR_MISMATCH if the ranks
 * disagree on the collective, count, dtype or op; KOLO_ERR_PEER_LOST naming the lost rank;
 * KOLO_ERR_TIMEOUT. count == 0 is valid and still synchronises nothing.
 */
KOLO_API kolo_status_t kolo_allreduce(kolo_comm_t comm, const void *sendbuf, void *recvbuf,
                                      uint64_t count, kolo_dtype_t dtype, kolo_op_t op);

/*
 * kolo_allreduce with scale factors, as Horovod's prescale/postscale: each rank's input is
 * multiplied by prescale before the reduction, and the result by postscale after it (after the
 * division of KOLO_AVG). For integer dtypes the product is computed in double, truncated toward
 * zero and saturated at the type's limits.
 * Both factors must be finite. Errors as kolo_allreduce, plus KOLO_ERR_MISMATCH if the ranks pass
 * different factors.
 */
KOLO_API kolo_status_t kolo_allreduce_scaled(kolo_comm_t comm, const void *sendbuf, void *recvbuf,
                                             uint64_t count, kolo_dtype_t dtype, kolo_op_t op,
                                             double prescale, double postscale);

/*
 * Copies count elements of buf on rank root into buf on every other rank (the initial weights of
 * a model, for example). buf is read on the root and written elsewhere. Blocks until done.
 * Returns KOLO_ERR_INVALID_ARGUMENT for a root outside [0, size), a NULL buf with count > 0 or an
 * unknown dtype; KOLO_ERR_MISMATCH if the ranks disagree on root, count or dtype; otherwise as
 * kolo_allreduce.
 */
KOLO_API kolo_status_t kolo_broadcast(kolo_comm_t comm, void *buf, uint64_t count,
                                      kolo_dtype_t dtype, int root);

/*
 * Returns only once every rank of comm has entered the barrier. Errors as kolo_allreduce.
 */
KOLO_API kolo_status_t kolo_barrier(kolo_comm_t comm);

/*
 * Gathers count elements from every rank's sendbuf into every rank's recvbuf, in rank order:
 * recvbuf holds size * count elements, rank r's at element r * count. In place: sendbuf ==
 * recvbuf + rank * count (this rank's block of recvbuf, as NCCL defines it); otherwise the buffers
 * must not overlap. Buffers stay owned by the caller; sendbuf is only read. Blocks until done.
 *
 * Uses a ring (each rank sends (N-1)/N of recvbuf, pipelined), or for small buffers Bruck's
 * algorithm (ceil(log2 N) steps); see the README for the switch point.
 * Returns KOLO_ERR_INVALID_ARGUMENT for a NULL comm, a NULL buffer with count > 0, overlapping
 * buffers that are not in place, a size * count too large to address, or an unknown dtype
 * (nothing is sent); KOLO_ERR_MISMATCH if the ranks disagree on the collective, count or dtype;
 * otherwise as kolo_allreduce.
 */
KOLO_API kolo_status_t kolo_allgather(kolo_comm_t comm, const void *sendbuf, void *recvbuf,
                                      uint64_t count, kolo_dtype_t dtype);

/*
 * kolo_allgather with a count per rank (Horovod's allgather of tensors whose first dimension
 * differs): counts is an array of size elements, the same on every rank; rank r contributes
 * counts[r] elements (zero is allowed) from its sendbuf, and recvbuf receives every rank's
 * elements back to back in rank order (rank r's at the sum of counts[0..r-1]). In place: sendbuf
 * is this rank's block of recvbuf. counts is read during the call only. Blocks until done.
 * Returns KOLO_ERR_INVALID_ARGUMENT for a NULL counts, counts whose sum is too large, or the
 * errors of kolo_allgather; KOLO_ERR_MISMATCH if the ranks pass different counts (the
 * descriptor of every message carries a hash of them), a different dtype or another collective.
 */
KOLO_API kolo_status_t kolo_allgatherv(kolo_comm_t comm, const void *sendbuf, void *recvbuf,
                                       const uint64_t *counts, kolo_dtype_t dtype);

/*
 * Reduces every rank's sendbuf of size * count elements with op and scatters the result: rank r
 * receives elements [r * count, (r + 1) * count) of the reduction in its recvbuf of count
 * elements. In place: recvbuf == sendbuf + rank * count (this rank's block of sendbuf); otherwise
 * the buffers must not overlap. Every dtype and op of kolo_allreduce, with the same arithmetic
 * (half types accumulate in float32 and round once); bitwise the same result in every run.
 * sendbuf is never written except, in place, this rank's block. Blocks until done.
 *
 * Uses a ring: each rank sends (N-1)/N of sendbuf, pipelined.
 * Returns KOLO_ERR_INVALID_ARGUMENT for a NULL comm, a NULL buffer with count > 0, overlapping
 * buffers that are not in place, or an unknown dtype or op (nothing is sent); KOLO_ERR_MISMATCH
 * if the ranks disagree on the collective, count, dtype or op; otherwise as kolo_allreduce.
 */
KOLO_API kolo_status_t kolo_reduce_scatter(kolo_comm_t comm, const void *sendbuf, void *recvbuf,
                                           uint64_t count, kolo_dtype_t dtype, kolo_op_t op);

/*
 * kolo_reduce_scatter with a count per rank: counts is an array of size elements, the same on
 * every rank; sendbuf holds their sum, and rank r receives counts[r] elements (zero is allowed),
 * those at the sum of counts[0..r-1]. In place: recvbuf is this rank's block of sendbuf. counts
 * is read during the call only. Returns KOLO_ERR_INVALID_ARGUMENT for a NULL counts, counts whose
 * sum is too large, or the errors of kolo_reduce_scatter; KOLO_ERR_MISMATCH if the ranks pass
 * different counts, dtype, op or call another collective.
 */
KOLO_API kolo_status_t kolo_reduce_scatterv(kolo_comm_t comm, const void *sendbuf, void *recvbuf,
                                            const uint64_t *counts, kolo_dtype_t dtype,
                                            kolo_op_t op);

/*
 * Every rank sends a block of count elements to every rank: sendbuf and recvbuf hold size * count
 * elements; block p of rank r's sendbuf arrives as block r of rank p's recvbuf. sendbuf may equal
 * (or overlap) recvbuf: kolo then copies the blocks to send aside first. Blocks until done.
 *
 * Uses pairwise exchange over the connections between every pair of ranks: at step s rank r sends
 * to r + s and receives from r - s; each rank sends (N-1)/N of sendbuf.
 * Returns KOLO_ERR_INVALID_ARGUMENT for a NULL comm, a NULL buffer with count > 0, a size * count
 * too large to address, or an unknown dtype (nothing is sent); KOLO_ERR_MISMATCH if the ranks
 * disagree on the collective, count or dtype; otherwise as kolo_allreduce.
 */
KOLO_API kolo_status_t kolo_alltoall(kolo_comm_t comm, const void *sendbuf, void *recvbuf,
                                     uint64_t count, kolo_dtype_t dtype);

/*
 * Alltoall with counts and displacements per peer, as MPI_Alltoallv defines them (in elements of
 * dtype): sendcounts[p] elements at element sdispls[p] of sendbuf go to rank p, which receives
 * them as recvcounts[r] elements at element rdispls[r] of its recvbuf (r: the sender). Each array
 * has size entries; zero counts are allowed, and so are gaps between blocks. Rank p's
 * recvcounts[r] must equal rank r's sendcounts[p]; sendcounts[rank] must equal recvcounts[rank].
 * Send blocks may overlap one another; receive blocks must not. sendbuf may overlap recvbuf
 * (then the send blocks are copied aside first). The arrays are read during the call only.
 * Blocks until done.
 *
 * Returns KOLO_ERR_INVALID_ARGUMENT (nothing is sent) for a NULL comm or array, a negative
 * displacement, a displacement plus count that overflows, a NULL buffer where a count is not
 * zero, overlapping receive blocks, sendcounts[rank] != recvcounts[rank], or an unknown dtype;
 * KOLO_ERR_MISMATCH if two ranks disagree on what one sends the other (the message names both),
 * on the dtype or the collective: every rank returns it, since the call ends with an agreement
 * round; otherwise as kolo_allreduce.
 */
KOLO_API kolo_status_t kolo_alltoallv(kolo_comm_t comm, const void *sendbuf,
                                      const uint64_t *sendcounts, const int64_t *sdispls,
                                      void *recvbuf, const uint64_t *recvcounts,
                                      const int64_t *rdispls, kolo_dtype_t dtype);

/*
 * Reduces count elements of every rank's sendbuf with op into recvbuf on rank root; recvbuf is
 * ignored (and may be NULL) on the other ranks. In place on the root: sendbuf == recvbuf;
 * otherwise they must not overlap there. The arithmetic of kolo_allreduce. Blocks until done on
 * this rank (a rank other than the root may return before the root has finished).
 *
 * Uses a pipelined chain round the ring ending at the root (each link carries the buffer once),
 * after an agreement round so that ranks that disagree all fail.
 * Returns KOLO_ERR_INVALID_ARGUMENT for a root outside [0, size), a NULL sendbuf (or a NULL
 * recvbuf on the root) with count > 0, overlapping buffers on the root, an unknown dtype or op;
 * KOLO_ERR_MISMATCH if the ranks disagree on root, count, dtype or op; otherwise as
 * kolo_allreduce.
 */
KOLO_API kolo_status_t kolo_reduce(kolo_comm_t comm, const void *sendbuf, void *recvbuf,
                                   uint64_t count, kolo_dtype_t dtype, kolo_op_t op, int root);

/* ---- Point to point ------------------------------------------------------------------------ */

/*
 * Sends count elements of buf to rank peer, which must call kolo_recv(comm, ..., this rank, tag)
 * with the same count, dtype and tag (tag >= 0). Blocks until the receiver has taken the data
 * (a synchronous send: the receiver acknowledges), bounded by the timeout. buf is only read.
 *
 * Ordering, as NCCL's send/recv: the messages between two ranks are matched in the order they
 * are called, and they share the ordered connections of the collectives, so both ranks must call
 * their sends, receives and collectives on comm in the same order; the tag is checked, never used
 * to pick a message. Since a send waits for its receive, two ranks that both send to each other
 * before receiving cannot proceed: order such exchanges (the lower rank sends first, say).
 *
 * Returns KOLO_ERR_INVALID_ARGUMENT for a peer outside [0, size) or equal to this rank, a negative
 * tag, a NULL buf with count > 0 or an unknown dtype (nothing is sent); KOLO_ERR_MISMATCH if the
 * receiver expects another count, dtype or tag, or is in another call (both ranks get it, and, as
 * after any failure, the communicator is broken on every rank); KOLO_ERR_PEER_LOST,
 * KOLO_ERR_TIMEOUT.
 */
KOLO_API kolo_status_t kolo_send(kolo_comm_t comm, const void *buf, uint64_t count,
                                 kolo_dtype_t dtype, int peer, int tag);

/*
 * Receives count elements from rank peer into buf: the next message that peer sends this rank
 * with kolo_send, which must have the same count, dtype and tag. Blocks until the data has
 * arrived, bounded by the timeout. buf is written during the call only. Ordering and errors as
 * kolo_send.
 */
KOLO_API kolo_status_t kolo_recv(kolo_comm_t comm, void *buf, uint64_t count, kolo_dtype_t dtype,
                                 int peer, int tag);

/* ---- Sub-communicators --------------------------------------------------------------------- */

/* A colour for kolo_comm_split that joins no new communicator (any negative colour does). */
#define KOLO_COLOR_NONE (-1)

/*
 * Splits comm: the ranks that pass the same colour form a new communicator, ranked by key (ties
 * by their rank in comm), as MPI_Comm_split and ncclCommSplit. A collective call on comm: every
 * rank of comm must call it, in the same order as comm's other collectives. A rank that passes a
 * negative colour (KOLO_COLOR_NONE) joins none: it gets *newcomm == NULL and KOLO_SUCCESS.
 *
 * On success *newcomm is a new communicator that the caller owns and must pass to
 * kolo_comm_destroy(). It has its own connections: its operations never mix with those of comm or
 * of other communicators, even when threads use them at the same time, and it keeps working after
 * comm is destroyed (and comm after it is). Splitting needs the rendezvous store, which the
 * process of rank 0 of the job serves while it holds any communicator. Blocks until every rank of
 * comm has created its new communicator.
 *
 * Returns KOLO_ERR_INVALID_ARGUMENT for a NULL comm or newcomm (nothing is sent); otherwise the
 * errors of kolo_allreduce on comm, or, when a new communicator could not be connected, that
 * failure on every rank of comm (comm itself keeps working then). *newcomm is NULL on failure.
 */
KOLO_API kolo_status_t kolo_comm_split(kolo_comm_t comm, int color, int key,
                                       kolo_comm_t *newcomm);

/* ---- Surviving a lost rank ----------------------------------------------------------------- */

/*
 * Shrinks comm to the ranks that are still alive (ULFM's MPI_Comm_shrink, ncclCommShrink). Every
 * surviving rank of comm calls it, typically after a call on comm failed with KOLO_ERR_PEER_LOST
 * or KOLO_ERR_TIMEOUT. On success *newcomm is a new communicator (the caller owns it, as one from
 * kolo_comm_init) of exactly the ranks of comm that took part, ranked in their order in comm,
 * that behaves as a freshly created one: its own connections, rendezvous store, sequence numbers
 * and fusion engine (named operations start clean on it), and it can be split and shrunk again.
 *
 * comm itself is broken by the call if it was not already, and its peers are told at once, so
 * that a rank still waiting in a collective on comm fails now (and comes to shrink) instead of
 * at its timeout: every later call on comm, and every named request still pending on it, fails
 * with KOLO_ERR_PEER_LOST. comm stays valid until kolo_comm_destroy(), and kolo_comm_shrink may
 * be called on it again (after an error, say).
 *
 * How the survivors agree. Each rank of comm listens, from the moment comm is created, on an
 * address of its own that every rank of comm learnt then, so no rendezvous store is needed: the
 * process of rank 0, which serves the job's store, may be the one lost. The coordinator is the
 * lowest rank of comm whose process is alive. A rank counts as gone only on evidence: its host
 * refuses or resets the connection (its process is gone), says it is unreachable, or a connection
 * held to it closes. A rank that neither answers nor shows such evidence (its host is silent, or
 * strangers crowd its port) is no reason to leave it out: the call fails with KOLO_ERR_TIMEOUT
 * naming it, on the ranks that asked, and may be called again. It waits for every
 * rank whose process is alive to call kolo_comm_shrink, up to twice KOLO_TIMEOUT from its own call
 * (a survivor may first have to finish another blocking call, bounded by KOLO_TIMEOUT);
 * decides the members (itself and every rank that called and is still connected to it); serves
 * the new communicator's rendezvous store; and is its rank 0. Guarantees:
 *   - Every rank that returns KOLO_SUCCESS holds a communicator of the same members, formed by
 *     one decision of one coordinator; every other rank of comm returns an error. No rank waits
 *     longer than about three times KOLO_TIMEOUT (and a build that fails on a lost member adds
 *     one more).
 *   - Whether a rank is a member depends on nothing but its own call: a rank that other ranks
 *     reported lost (it was only slow) and that calls within twice KOLO_TIMEOUT of the coordinator is
 *     a member.
 *   - A rank that dies during the call is left out and the others go on without it, whether it
 *     dies before the decision or while the members connect (the coordinator then decides
 *     again). If the coordinator dies before its decision, the others start again with the next
 *     rank as coordinator. If it dies after deciding and before every member has connected, every
 *     rank still in the call returns KOLO_ERR_PEER_LOST naming it: call kolo_comm_shrink again.
 *   - A rank that is left out although alive (it called more than twice KOLO_TIMEOUT after the
 *     coordinator) returns KOLO_ERR_PEER_LOST at once, saying that the coordinator already
 *     committed to a communicator without it: the coordinator's process keeps comm's listener
 *     open while it holds the new communicator. Only if the coordinator's process is gone too
 *     does it find no rank before it and form, at worst, a communicator of the ranks as late as
 *     itself.
 *   - Nothing a process without the job secret does (connections that say nothing, garbage,
 *     floods at any port) makes a live rank look gone or changes what the ranks agree on
 *     (docs/security.md). It cannot join or disturb the communicator the
 *     others formed: only the members learn its store's address and its context, which every
 *     connection of it must name besides proving the job secret.
 *
 * Growing a communicator again (new processes joining it) is kolo_comm_grow's, below.
 *
 * Returns KOLO_ERR_INVALID_ARGUMENT for a NULL comm or newcomm (nothing happens); otherwise
 * KOLO_SUCCESS, or an error as above with *newcomm NULL.
 */
KOLO_API kolo_status_t kolo_comm_shrink(kolo_comm_t comm, kolo_comm_t *newcomm);

/* ---- Growing a communicator ---------------------------------------------------------------- */

/* The longest invitation kolo_comm_invite writes, its terminating NUL included. */
#define KOLO_INVITATION_MAX 128

/*
 * Growing: the ranks of comm (the members) and new processes (the newcomers) form a larger
 * communicator together (ncclCommGrow; Horovod's elastic mode adding hosts). Three steps:
 *   1. Rank 0 of comm calls kolo_comm_invite and hands the invitation, a short text, to the
 *      newcomers out of band (a launcher puts it in their environment as KOLO_INVITATION), and to
 *      the other members if they need to know that growth is coming.
 *   2. Each newcomer calls kolo_comm_init with KOLO_INVITATION set in its environment: its rank,
 *      size, local rank and size and rendezvous address then come from the growth (those fields
 *      of config, KOLO_RANK, KOLO_SIZE, KOLO_ADDR and the launchers' variables are ignored); the
 *      rest of its configuration (KOLO_SECRET, KOLO_TIMEOUT, ...) is read as usual and should
 *      match the members' (KOLO_ALLREDUCE must: a newcomer whose value differs from rank 0's
 *      fails the growth with KOLO_ERR_CONFIG everywhere, as at a job's start). kolo_comm_init then blocks until the growth is decided and connected
 *      (see kolo_comm_grow), and fails with KOLO_ERR_CONFIG for an invitation that is malformed,
 *      forged, stale (used or replaced) or used up, naming which.
 *   3. Every member calls kolo_comm_grow with the same new_size.
 * Newcomers may start before or after the members call kolo_comm_grow: rank 0 waits for them up
 * to KOLO_TIMEOUT from its call, and a newcomer waits for rank 0's decision up to twice
 * KOLO_TIMEOUT from its arrival (as the other members do, so that they read why a growth failed
 * rather than time out beside it).
 *
 * Writes the invitation for the next kolo_comm_grow of comm into buf (len bytes, at most
 * KOLO_INVITATION_MAX needed), NUL-terminated: "kolo-grow-1:<token>:<host:port>", where
 * host:port is a rendezvous store that rank 0 starts for the growth (on the address its other
 * connections listen on) and token a fresh random number. Call it on rank 0 of comm only; it
 * sends nothing to the other members and returns at once. A later call replaces the invitation
 * (newcomers holding the earlier one are refused, as stale), and an invitation serves one growth:
 * once kolo_comm_grow has used it (successfully or not), a newcomer that comes with it is
 * refused, saying so. The invitation is no secret: a process without the job secret cannot use
 * it, because every connection to that store proves the secret (docs/security.md).
 *
 * Returns KOLO_ERR_INVALID_ARGUMENT for a NULL comm or buf, len smaller than the invitation (the
 * message says how long it is), or a comm of which this is not rank 0; comm's error if it is
 * broken; KOLO_ERR_SYSTEM if the store cannot listen. buf is untouched on failure.
 */
KOLO_API kolo_status_t kolo_comm_invite(kolo_comm_t comm, char *buf, size_t len);

/*
 * Called by every member of comm, with the same new_size (> comm's size): forms, with the
 * new_size - size newcomers that came with rank 0's current invitation (kolo_comm_init with
 * KOLO_INVITATION), a communicator of new_size ranks. The members keep their ranks 0..size-1 and
 * their order; the newcomers follow, ordered by host (ranks of one host together) and, within a
 * host, by process id. Every member and every newcomer returns the same membership, or an error.
 * On success *newcomm is a new communicator (the caller owns it, as one from kolo_comm_init) that
 * behaves as a freshly created one: its own connections, sequence numbers and fusion engine
 * (named operations start clean on it), and it can be split, shrunk and grown again. Its
 * rendezvous store is the one rank 0 of comm started for the invitation, served by rank 0's
 * process while it holds the new communicator; the store of the job's rank 0 plays no part.
 *
 * Steps and guarantees:
 *   - First the members exchange their new_size and rank 0's invitation over comm (a collective
 *     on comm: the other members must call kolo_comm_grow too, as their next call on comm).
 *     Members that passed different sizes all get KOLO_ERR_MISMATCH naming the two sizes, and
 *     when rank 0 has made no invitation all get KOLO_ERR_INVALID_ARGUMENT; in both cases comm is
 *     unchanged and usable, the invitation is used up, and the newcomers waiting fail with the
 *     same message.
 *   - Then comm is broken on every member: every later call on comm, and every named request
 *     still pending on it, fails with KOLO_ERR_CANCELLED ("grew ... use the new communicator").
 *     comm stays valid until kolo_comm_destroy(). After a failed growth kolo_comm_shrink(comm)
 *     gives the members a working communicator of themselves again.
 *   - Rank 0 waits, up to KOLO_TIMEOUT, for every member and for new_size - size newcomers; it
 *     takes the first that arrive, and a newcomer that comes later is refused (the invitation is
 *     used up). Too few newcomers within KOLO_TIMEOUT: KOLO_ERR_TIMEOUT on every member and
 *     newcomer, saying how many came.
 *   - Then every rank connects the new communicator and tells the others whether it could; every
 *     rank returns success only if all could. A newcomer (or member) that dies while joining is
 *     not left out: the call fails on every other rank with KOLO_ERR_TIMEOUT or
 *     KOLO_ERR_PEER_LOST saying what was missing (each wait bounded by KOLO_TIMEOUT, the whole
 *     call by about three times KOLO_TIMEOUT). When rank 0's process dies, every other member
 *     and newcomer fails with KOLO_ERR_PEER_LOST (its store goes with it).
 *
 * Returns KOLO_ERR_INVALID_ARGUMENT for a NULL comm or newcomm, or a new_size not larger than
 * comm's size or above 2^20 (nothing is sent, comm usable); otherwise KOLO_SUCCESS or an error as
 * above, with *newcomm NULL.
 */
KOLO_API kolo_status_t kolo_comm_grow(kolo_comm_t comm, int new_size, kolo_comm_t *newcomm);

/* ---- Elastic jobs under a launcher --------------------------------------------------------- */

/* What one kolo_elastic_update did (all zero when it changed nothing). */
typedef struct kolo_elastic_update {
  int changed;  /* 1: ranks left or joined in this call; 0: nothing to do (*newcomm is NULL) */
  int leaving;  /* 1 on a rank whose slot the launcher removed: *newcomm is NULL */
  int joined;   /* ranks that joined */
  int left;     /* ranks that left (gracefully, at this call) */
  int old_size; /* comm's size */
  int new_size; /* the new communicator's size (comm's when nothing changed, 0 on a leaving rank) */
} kolo_elastic_update_t;

/*
 * Applies the plan of the launcher's elastic driver (`kolorun --elastic --host-discovery-script`,
 * docs/elastic.md): ranks on hosts that went away leave, and ranks the driver started on new or
 * freed slots join. A collective call on comm: every rank calls it at the same point, such as
 * each commit of the training state, in the same order as comm's other collectives.
 *
 * Without KOLO_ELASTIC_ADDR in the environment it returns KOLO_SUCCESS at once with changed = 0,
 * *newcomm NULL, and sends nothing. Under the driver, which sets KOLO_ELASTIC_ADDR (its store,
 * authenticated with the job secret) and KOLO_ELASTIC_SLOT (each process's slot, "host:n"):
 *   1. Every rank's slot is gathered to rank 0 (a collective on comm), which asks the driver for
 *      the plan: one request, answered at once, waited for up to KOLO_TIMEOUT.
 *   2. Rank 0 broadcasts the plan over comm, so that every rank acts on the same one. No change:
 *      changed = 0, *newcomm NULL, comm as before.
 *   3. The ranks whose slots the plan removes get leaving = 1 and *newcomm NULL: they should
 *      destroy comm and exit with status 0 (the driver does not count that as a failure; a rank
 *      still running a grace time after it left is killed). The others form, as kolo_comm_split
 *      does, a communicator of the ranks that stay, in their order in comm.
 *   4. When newcomers join, the rank 0 of those that stay makes an invitation (kolo_comm_invite)
 *      and hands it to the driver, which starts the newcomers with KOLO_INVITATION (and without
 *      KOLO_RANK or KOLO_SIZE): their kolo_comm_init joins the growth. The members then grow
 *      (kolo_comm_grow) to the new size; the newcomers are ranked after them.
 * On success *newcomm (when changed and not leaving) is a new communicator the caller owns, as
 * one from kolo_comm_init, with its own connections and fusion engine; comm stays valid until
 * kolo_comm_destroy and is, after a growth, broken: every later call on it and every named
 * request still pending on it fails with KOLO_ERR_CANCELLED (after a removal alone, comm keeps
 * working, as after a split). Destroy comm and go on with *newcomm.
 *
 * Errors, with kolo_comm_last_error naming what happened; every wait is bounded by KOLO_TIMEOUT:
 *   - The driver cannot be reached, or its answer cannot be read (steps 1-2): every rank returns
 *     the same status (KOLO_ERR_TIMEOUT, KOLO_ERR_PEER_LOST, KOLO_ERR_SYSTEM, ...) and the same
 *     message; nothing changed and comm is usable. Call again at the next commit.
 *   - A rank of comm that is lost meanwhile: the errors of kolo_allreduce (KOLO_ERR_PEER_LOST);
 *     recover with kolo_comm_shrink, as after any lost rank.
 *   - A growth that fails (a newcomer that died while joining, too few newcomers within
 *     KOLO_TIMEOUT): every member returns kolo_comm_grow's error, and the communicator it was
 *     grown from is broken. kolo_comm_shrink(comm) then gives the ranks that stayed a working
 *     communicator again (the ranks that left are gone), and the next kolo_elastic_update asks
 *     the driver again: it restarts a newcomer that failed, within its --reset-limit.
 * A KOLO_ELASTIC_SLOT that is missing or malformed on any rank fails every rank with
 * KOLO_ERR_CONFIG naming that rank (comm usable).
 *
 * Returns KOLO_ERR_INVALID_ARGUMENT for a NULL comm, update or newcomm (nothing is sent, comm
 * usable); otherwise KOLO_SUCCESS or an error as above, with *newcomm NULL. *update is zeroed
 * first and filled on success.
 */
KOLO_API kolo_status_t kolo_elastic_update(kolo_comm_t comm, kolo_elastic_update_t *update,
                                           kolo_comm_t *newcomm);

/* ---- Named asynchronous operations: the fusion engine ------------------------------------- */

/*
 * Horovod's way of reducing gradients. Every rank submits the same tensors, each under a name
 * (such as "layer3.conv.weight.grad"), in any order and from any thread, and gets a request
 * handle back at once. A background thread of the communicator (started by its first named call)
 * finds out every cycle (KOLO_CYCLE_TIME_MS) which names every rank has submitted, packs those
 * with the same dtype, op and scale factors into a buffer of up to KOLO_FUSION_THRESHOLD bytes,
 * and runs one collective per buffer, in the same order on every rank (a tensor of 1 MiB or more
 * runs alone, in place: its latency is small beside its transfer, and copying would cost more
 * than fusing saves). In a steady training loop the negotiation costs one small message per rank
 * and cycle (the response cache, of KOLO_CACHE_CAPACITY entries); an idle communicator costs no
 * CPU and sends nothing.
 *
 * Results are bitwise the same whether a tensor is fused with others or reduced alone, on every
 * rank and in every run. (They use the ring schedule; kolo_allreduce uses recursive doubling for
 * buffers of at most 32 KiB times N bytes, so its results on those may differ in the last bit.)
 *
 * Named operations use connections of their own: they may be used while other threads make
 * ordered calls (kolo_allreduce, ...) on the same communicator, and never disturb them.
 *
 * Buffers belong to the caller, who must keep them valid, and not write sendbuf nor touch
 * recvbuf, from submission until the request has completed (kolo_request_test reports done,
 * kolo_request_wait returns, or the callback has been called). kolo does not touch them after
 * that. Names are copied; they are NUL-terminated, 1 to 1024 bytes long.
 *
 * Names: a name identifies one tensor across ranks; every rank must submit it, with the same
 * count, dtype, op, scale factors (or root; for an allgather only the dtype, since each rank
 * sends a count of its own). A name may be submitted again once its previous request has
 * completed (every training step, typically); submitting a name that is still pending on this
 * rank, as any kind of operation, returns KOLO_ERR_INVALID_ARGUMENT.
 *
 * Errors of a request (kolo_request_wait's status and kolo_request_last_error's message):
 *   KOLO_ERR_MISMATCH   ranks submitted the name with a different count, dtype, op, factors or
 *                       root, or as members of different groups, or as different operations;
 *                       every rank's request for that name fails, naming the tensor, the ranks
 *                       and what each submitted. Other tensors, and the communicator, are not
 *                       affected.
 *   KOLO_ERR_INVALID_ARGUMENT  an allgather whose gathered result does not fit in some rank's
 *                       recv_capacity: every rank's request for that name fails, naming the
 *                       tensor, every rank's count, the total and the ranks whose capacity is
 *                       too small; no buffer is written. Other tensors are not affected.
 *   KOLO_ERR_TIMEOUT    with KOLO_STALL_ABORT_S > 0: some ranks submitted the name and others
 *                       did not within that time; the message names the missing ranks. (Rank 0
 *                       logs a warning naming them after KOLO_STALL_WARNING_S.)
 *   KOLO_ERR_PEER_LOST  a rank was lost (the message names it): every pending request fails,
 *                       and so does every later submission. Likewise any other failure of the
 *                       communicator, including one in an ordered call.
 *   KOLO_ERR_CANCELLED  the communicator was destroyed before the request completed.
 */

/* An opaque handle to a submitted named operation. */
typedef struct kolo_request *kolo_request_t;

/* Called once when a request completes, with its status and the user_data given at submission.
 * It runs on the engine's thread (or, for a cancellation, on the thread destroying the
 * communicator) before the request reports done: it must return quickly, may submit new named
 * operations, and must neither wait for its own request nor destroy the communicator. */
typedef void (*kolo_callback_t)(kolo_status_t status, void *user_data);

/*
 * Options of a named operation. Fill it with KOLO_ASYNC_OPTIONS_INITIALIZER and set only what
 * you need; NULL instead of a pointer to it means all defaults. struct_size lets later versions
 * add fields.
 */
typedef struct kolo_async_options {
  size_t struct_size;        /* sizeof(kolo_async_options_t), set by the initializer */
  double prescale;           /* 1.0: each rank's input is multiplied by it (allreduce only) */
  double postscale;          /* 1.0: the result is multiplied by it, after KOLO_AVG's division */
  kolo_callback_t callback;  /* NULL: none */
  void *user_data;           /* passed to the callback */
} kolo_async_options_t;

#define KOLO_ASYNC_OPTIONS_INITIALIZER { sizeof(kolo_async_options_t), 1.0, 1.0, NULL, NULL }

/*
 * Submits the allreduce of count elements of sendbuf (as kolo_allreduce_scaled: sendbuf ==
 * recvbuf reduces in place) under `name`, and returns at once with *request, which the caller
 * owns and must pass to kolo_request_free. Does not block (the first call on a communicator
 * starts its engine thread, which connects to the peers in the background).
 *
 * Returns KOLO_ERR_INVALID_ARGUMENT, with *request = NULL and nothing submitted, for a NULL comm,
 * name or request, a name that is empty, longer than 1024 bytes or still pending on this rank, a
 * NULL buffer with count > 0, partially overlapping buffers, an unknown dtype or op, non-finite
 * factors or an options struct with a wrong struct_size; KOLO_ERR_UNSUPPORTED for a buffer in GPU
 * memory (named operations take host memory so far); the communicator's failure status (such as
 * KOLO_ERR_PEER_LOST) once it is broken. kolo_comm_last_error(comm) says which.
 */
KOLO_API kolo_status_t kolo_allreduce_async(kolo_comm_t comm, const char *name,
                                            const void *sendbuf, void *recvbuf, uint64_t count,
                                            kolo_dtype_t dtype, kolo_op_t op,
                                            const kolo_async_options_t *options,
                                            kolo_request_t *request);

/*
 * Submits the broadcast of count elements of buf from rank root under `name` (buf is read on the
 * root and written elsewhere), and returns at once. The factors of options are ignored. Errors as
 * kolo_allreduce_async, plus KOLO_ERR_INVALID_ARGUMENT for a root outside [0, size); a request
 * fails with KOLO_ERR_MISMATCH when ranks name different roots.
 */
KOLO_API kolo_status_t kolo_broadcast_async(kolo_comm_t comm, const char *name, void *buf,
                                            uint64_t count, kolo_dtype_t dtype, int root,
                                            const kolo_async_options_t *options,
                                            kolo_request_t *request);

/*
 * Submits n allreduces that are negotiated and run together, in one collective (one fused
 * buffer, grown beyond KOLO_FUSION_THRESHOLD if the group needs it; with fusion off, one after
 * the other in the same cycle), as one request. Member i reduces counts[i] elements of
 * sendbufs[i] into recvbufs[i] (the same pointer reduces in place) under names[i]; all members
 * share dtype, op and the options' factors. Every rank must submit the same group: the same
 * names in the same order with the same counts (else KOLO_ERR_MISMATCH for the group, named by
 * its first member). The arrays are read during the call only. 1 <= n <= 4096.
 *
 * Errors as kolo_allreduce_async, plus KOLO_ERR_INVALID_ARGUMENT for n out of range, NULL arrays,
 * a name given twice, or receive buffers that overlap each other.
 */
KOLO_API kolo_status_t kolo_allreduce_group_async(kolo_comm_t comm, int n,
                                                  const char *const *names,
                                                  const void *const *sendbufs,
                                                  void *const *recvbufs, const uint64_t *counts,
                                                  kolo_dtype_t dtype, kolo_op_t op,
                                                  const kolo_async_options_t *options,
                                                  kolo_request_t *request);

/*
 * Submits an allgather under `name` and returns at once, as kolo_allreduce_async. Horovod's
 * allgather: every rank sends a count of its own (count elements of sendbuf; ranks may differ, and
 * zero is allowed), and every rank receives all of them back to back in rank order in recvbuf,
 * rank r's block at the sum of the counts of ranks 0..r-1. recvbuf holds recv_capacity elements;
 * elements past the gathered total are not written. kolo_request_counts tells every rank's count
 * once the request has completed. Ranks must agree on the dtype only. The buffers must not overlap
 * (a named allgather does not run in place). The factors of options are ignored. Allgathers are
 * never fused (each is one collective of its own) and never held in the response cache: every
 * submission is negotiated in full, so counts may change from one step to the next.
 *
 * Errors as kolo_allreduce_async (KOLO_ERR_INVALID_ARGUMENT at once for a NULL sendbuf with
 * count > 0, a NULL recvbuf with recv_capacity > 0, or overlapping buffers). The request fails on
 * every rank with KOLO_ERR_INVALID_ARGUMENT when the total of all ranks' counts exceeds the
 * recv_capacity of any rank (nothing is written on any rank), and with KOLO_ERR_MISMATCH when
 * ranks submit the name with different dtypes or as another operation.
 */
KOLO_API kolo_status_t kolo_allgather_async(kolo_comm_t comm, const char *name,
                                            const void *sendbuf, uint64_t count, void *recvbuf,
                                            uint64_t recv_capacity, kolo_dtype_t dtype,
                                            const kolo_async_options_t *options,
                                            kolo_request_t *request);

/*
 * Copies the per-rank counts of a completed allgather (kolo_allgather_async): counts[r] = the
 * elements rank r sent, for each of the communicator's size ranks, into the first size entries of
 * counts, which has room for n. Does not block. Returns KOLO_SUCCESS; the request's own error
 * status if it failed (counts untouched); KOLO_ERR_INVALID_ARGUMENT, counts untouched, for a NULL
 * request or counts, a request that is not an allgather or that has not completed yet, or n
 * smaller than the communicator's size (kolo_request_last_error then says which).
 */
KOLO_API kolo_status_t kolo_request_counts(kolo_request_t request, uint64_t *counts, int n);

/*
 * Does not block. While the request is pending: *done = 0 and KOLO_SUCCESS. Once it has
 * completed: *done = 1 and the request's status (KOLO_SUCCESS, or its error; the message is in
 * kolo_request_last_error). KOLO_ERR_INVALID_ARGUMENT for a NULL request or done.
 */
KOLO_API kolo_status_t kolo_request_test(kolo_request_t request, int *done);

/*
 * Blocks until the request has completed and returns its status; bounded by the communicator's
 * timeout (KOLO_TIMEOUT): if it is still pending then, returns KOLO_ERR_TIMEOUT and the request
 * stays pending (wait again, or destroy the communicator to cancel it; its buffers are still in
 * use until then). Works after the communicator has been destroyed (KOLO_ERR_CANCELLED, unless it
 * had completed). KOLO_ERR_INVALID_ARGUMENT for a NULL request.
 */
KOLO_API kolo_status_t kolo_request_wait(kolo_request_t request);

/*
 * The message of the request's error ("" on success or while pending, unless a wait timed out),
 * naming the tensor and the ranks involved; or, right after kolo_request_counts refused with
 * KOLO_ERR_INVALID_ARGUMENT, why it did. The string is this thread's copy, valid until this
 * thread calls kolo_request_last_error again, even after the request is freed; NULL request: "".
 */
KOLO_API const char *kolo_request_last_error(kolo_request_t request);

/*
 * Frees the handle. A request still pending is not cancelled: it completes in the background (its
 * callback still runs) and its buffers stay in use until then. Never blocks.
 * KOLO_ERR_INVALID_ARGUMENT for NULL.
 */
KOLO_API kolo_status_t kolo_request_free(kolo_request_t request);

/*
 * Horovod's join, for ranks with uneven data: a rank that has run out of data calls kolo_join and
 * submits nothing more. Until every rank of comm has joined, the named operations that the others
 * submit run without waiting for it: a rank that has joined takes part with zeros (allreduce: its
 * contribution is zero, so KOLO_OP_SUM gives the sum over the ranks that have not joined, and
 * KOLO_OP_AVG that sum divided by the number of ranks of comm, as in Horovod; allgather: it
 * contributes no elements); a broadcast fails with KOLO_ERR_INVALID_ARGUMENT on the ranks that
 * submitted it (a root that has joined has no data, a rank that has joined would not receive it,
 * as Horovod refuses it). Named calls on a rank that has joined fail with
 * KOLO_ERR_INVALID_ARGUMENT. Ordered collectives are not affected: every rank must still call
 * them.
 *
 * Blocks until every rank has joined, then writes to *last_rank (if not NULL) the rank that
 * joined last (of ranks that joined in the same negotiation cycle, the highest) -- the same
 * value on every rank -- and the ranks may submit again. Bounded by KOLO_TIMEOUT: after it,
 * KOLO_ERR_TIMEOUT, and the rank stays joined (call kolo_join again to wait on). Fails with the
 * communicator's error when it breaks (KOLO_ERR_PEER_LOST, ...). Several threads may wait in
 * kolo_join on one communicator; they return together.
 */
KOLO_API kolo_status_t kolo_join(kolo_comm_t comm, int *last_rank);

/* Counters of the fusion engine of this rank, for tests, tuning and benchmarks. */
typedef struct kolo_fusion_stats {
  size_t struct_size;           /* set by the caller: sizeof(kolo_fusion_stats_t) */
  uint64_t cycles;              /* negotiation cycles this rank took part in */
  uint64_t idle_sleeps;         /* times no rank had work and the engine slept until woken */
  uint64_t tensors_submitted;   /* named tensors submitted here (group members one each) */
  uint64_t requests_completed;  /* requests that completed successfully */
  uint64_t requests_failed;     /* requests that completed with an error (or were cancelled) */
  uint64_t negotiated;          /* submissions agreed through full descriptions sent to rank 0 */
  uint64_t cache_hits;          /* submissions agreed through the response cache's bits alone */
  uint64_t collectives;         /* collectives the engine ran */
  uint64_t fused_collectives;   /* of those, the ones through the fusion buffer */
  uint64_t tensors_fused;       /* tensors that went through the fusion buffer */
  uint64_t bytes_copied;        /* bytes copied into and out of the fusion buffer */
  uint64_t fusion_buffer_bytes; /* the fusion buffer's size (allocated once, reused) */
  /* Added with the autotuner: a caller built before them passes a smaller struct_size, and they
   * are not written. */
  uint64_t autotune_updates;    /* responses that carried the autotuner's settings (KOLO_AUTOTUNE) */
  uint64_t autotune_settled;    /* 1 once the autotuner's final settings arrived: they stay */
  uint64_t fusion_threshold;    /* the fusion threshold in force on this rank (rank 0 plans) */
  double cycle_time_ms;         /* the cycle time in force on this rank */
  uint64_t segment_bytes;       /* the ring pipeline segment of the engine's collectives */
  /* Added with the time breakdown: where the engine's thread spent its time, wall clock in
   * nanoseconds since the engine started. A step's time outside the three is the engine's own
   * work between them and the submitting and waiting threads' (README, "Where a fused step's
   * time goes"). */
  uint64_t collective_ns;  /* inside collectives, waiting there for other ranks included */
  uint64_t copy_ns;        /* copying into and out of the fusion buffer */
  uint64_t negotiation_ns; /* in negotiation cycles: this rank's list, the exchange with
                              rank 0 (waiting for the slowest rank), rank 0's planning */
} kolo_fusion_stats_t;

/*
 * Fills *stats (up to stats->struct_size bytes, which the caller sets; fields the library does not
 * know are zeroed). All zero before the first named operation. Never blocks.
 * KOLO_ERR_INVALID_ARGUMENT for a NULL comm or stats or a struct_size smaller than the first two
 * fields.
 */
KOLO_API kolo_status_t kolo_comm_fusion_stats(kolo_comm_t comm, kolo_fusion_stats_t *stats);

/*
 * Sets the fusion threshold (the bytes one fused collective may hold; 0: no fusion) from the next
 * cycle on, overriding KOLO_FUSION_THRESHOLD; for benchmarks and autotuning. Rank 0 plans the
 * fusion for every rank, so rank 0's value is the one that counts; setting the same value on
 * every rank keeps that true if rank 0 changes. While rank 0 autotunes (KOLO_AUTOTUNE=1), its
 * autotuner chooses the threshold instead, and this call changes nothing that counts. At most
 * 4 GiB, else KOLO_ERR_INVALID_ARGUMENT. Never blocks.
 */
KOLO_API kolo_status_t kolo_comm_set_fusion_threshold(kolo_comm_t comm, uint64_t bytes);

/* ---- GPU buffers ---------------------------------------------------------------------------- */

/*
 * Buffers in GPU memory. In a build with CUDA, kolo_allreduce, kolo_allreduce_scaled,
 * kolo_broadcast, kolo_allgather and kolo_reduce_scatter accept device (or managed) memory as they
 * accept host memory: each buffer is looked up with cudaPointerGetAttributes, once the process has
 * a CUDA context (a process that never touched the GPU pays nothing: no lookup, no context). The
 * other collectives, point to point and the named asynchronous calls take host memory only (they
 * do not check). A call whose buffers are in device memory runs on the GPU path:
 *   - NCCL, when kolo was built with NCCL and every rank has a GPU of its own;
 *   - otherwise staged: device -> pinned host memory -> kolo's ring over TCP or UCX -> device, in
 *     pieces of 8 MiB whose copies overlap the ring (several ranks may share one GPU); allgather
 *     and reduce-scatter are staged whole.
 * KOLO_GPU_BACKEND=auto|nccl|staged chooses (auto: NCCL where it can run); the choice is made by
 * the first GPU collective on a communicator, the same on every rank, and kept.
 *
 * Rules for GPU buffers:
 *   - every rank passes device memory to the same call (a rank with host memory where the others
 *     have device memory gets KOLO_ERR_MISMATCH on the staged path and KOLO_ERR_TIMEOUT on NCCL's);
 *   - both buffers of a call are on one CUDA device, and a communicator keeps the device of its
 *     first GPU call (KOLO_ERR_INVALID_ARGUMENT otherwise, before anything is sent);
 *   - the blocking calls above behave as if issued on the legacy default stream and waited for:
 *     they start after the work already enqueued on it (and so on every blocking stream) and
 *     return once the result is in recvbuf. Work on a stream created with
 *     cudaStreamNonBlocking, or the per-thread default stream, must be synchronised first, or use
 *     the _on_stream calls below.
 * Arithmetic: the staged path computes as kolo does on host buffers (a buffer over 8 MiB as
 * pieces of 8 MiB, each reduced as a host call of that size would be), bitwise the same on every
 * rank and in every run. On the NCCL path results are NCCL's: float16 and bfloat16 sum in their
 * own precision, KOLO_AVG of floating types is NCCL's ncclAvg (each input multiplied by 1/N), a
 * float32 or float64 prescale with KOLO_SUM or KOLO_AVG is NCCL's pre-multiplying sum; integer
 * KOLO_AVG sums and then divides truncating, and other scale factors are applied on the device,
 * with the host's rules (see kolo_allreduce_scaled). NCCL does not check that the ranks' calls
 * agree: a mismatched call ends in KOLO_ERR_TIMEOUT rather than KOLO_ERR_MISMATCH.
 * Failures: every wait is bounded by the timeout and watches for NCCL's asynchronous errors and
 * for peers that kolo's own connections see die; on any failure the NCCL communicator is aborted
 * (no kernel is left waiting for a dead peer) and the kolo communicator breaks as for any other
 * failure. NCCL's errors keep NCCL's message: ncclRemoteError is KOLO_ERR_PEER_LOST,
 * ncclInvalidUsage KOLO_ERR_UNSUPPORTED, CUDA and system errors KOLO_ERR_SYSTEM.
 */

/*
 * kolo_allreduce_scaled on device buffers, stream-ordered as NCCL's calls are. stream is a
 * cudaStream_t (NULL: the legacy default stream) on the device of the buffers. The reduction
 * starts after the work already enqueued on stream, and work enqueued on stream afterwards sees
 * the result. On the NCCL path the call only enqueues and returns at once; on the staged path it
 * returns once the network part is done, with the copy back to the device enqueued. Use
 * kolo_stream_synchronize (not cudaStreamSynchronize, which would wait forever for a dead peer)
 * to wait for it with the communicator's timeout, or an event of your own on stream.
 * Buffers stay owned by the caller and must stay valid until the work has finished on stream.
 * Returns KOLO_ERR_UNSUPPORTED when kolo was built without CUDA or no GPU is visible (the message
 * gives CUDA's reason); KOLO_ERR_INVALID_ARGUMENT for buffers in host memory (count > 0) and as
 * kolo_allreduce_scaled; an earlier asynchronous failure on comm; otherwise as kolo_allreduce.
 */
KOLO_API kolo_status_t kolo_allreduce_scaled_on_stream(kolo_comm_t comm, const void *sendbuf,
                                                       void *recvbuf, uint64_t count,
                                                       kolo_dtype_t dtype, kolo_op_t op,
                                                       double prescale, double postscale,
                                                       void *stream);

/* kolo_allreduce_scaled_on_stream with prescale and postscale 1. */
KOLO_API kolo_status_t kolo_allreduce_on_stream(kolo_comm_t comm, const void *sendbuf,
                                                void *recvbuf, uint64_t count,
                                                kolo_dtype_t dtype, kolo_op_t op, void *stream);

/* kolo_broadcast of a device buffer, stream-ordered as kolo_allreduce_scaled_on_stream. */
KOLO_API kolo_status_t kolo_broadcast_on_stream(kolo_comm_t comm, void *buf, uint64_t count,
                                                kolo_dtype_t dtype, int root, void *stream);

/*
 * Blocks until all work enqueued on stream (a cudaStream_t; NULL: the legacy default stream) so
 * far has finished, kolo's and anything else, watching for NCCL's asynchronous errors and for lost
 * peers meanwhile. Bounded by the communicator's timeout: KOLO_ERR_TIMEOUT past it. A failure seen
 * while waiting breaks the communicator as a failed collective does, after aborting its NCCL
 * communicator so that the stream drains. KOLO_ERR_UNSUPPORTED without CUDA or a GPU.
 */
KOLO_API kolo_status_t kolo_stream_synchronize(kolo_comm_t comm, void *stream);

/*
 * The GPU path comm's device buffers take: "nccl" or "staged" once its first GPU collective has
 * chosen, "none" before. *name is a static string. Waits only for a collective that another
 * thread is running on comm. KOLO_ERR_INVALID_ARGUMENT for a NULL comm or name.
 */
KOLO_API kolo_status_t kolo_comm_gpu_backend(kolo_comm_t comm, const char **name);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KOLO_H */

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
 *
 * Blocking: every collective below blocks the calling thread until it has finished on this rank,
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

/* ---- Versions ------------------------------------------------------------------------------ */

#define KOLO_VERSION_MAJOR 0
#define KOLO_VERSION_MINOR 1
#define KOLO_VERSION_PATCH 0
/* One integer, major * 10000 + minor * 100 + patch, as returned by kolo_version(). */
#define KOLO_VERSION (KOLO_VERSION_MAJOR * 10000 + KOLO_VERSION_MINOR * 100 + KOLO_VERSION_PATCH)
/* The version of the structs in this header; bumped when a field is added. */
#define KOLO_API_VERSION 1

/* The version of the library actually loaded, in the form of KOLO_VERSION. Never fails. */
KOLO_API int kolo_version(void);

/* ---- Status codes -------------------------------------------------------------------------- */

typedef enum kolo_status {
  KOLO_SUCCESS = 0,
  KOLO_ERR_INVALID_ARGUMENT = 1, /* a NULL pointer, unknown dtype/op, bad root, bad config */
  KOLO_ERR_TIMEOUT = 2,          /* a wait ran past the communicator's timeout */
  KOLO_ERR_PEER_LOST = 3,        /* a rank died or its connection broke; the message names it */
  KOLO_ERR_MISMATCH = 4,         /* ranks called different collectives, counts, dtypes or ops */
  KOLO_ERR_INTERNAL = 5,         /* a bug in kolo; please report the message */
  KOLO_ERR_SYSTEM = 6,           /* an operating-system call failed (bind, connect, memory) */
  KOLO_ERR_CONFIG = 7,           /* the environment or config does not describe a usable job */
  KOLO_ERR_UNSUPPORTED = 8       /* valid, but not available in this build or on this machine */
} kolo_status_t;

/* A static English name for a status, such as "KOLO_ERR_PEER_LOST: a peer rank was lost".
 * Never NULL; unknown values give "unknown kolo status". */
KOLO_API const char *kolo_status_string(kolo_status_t status);

/* ---- Data types and reduction operations --------------------------------------------------- */

typedef enum kolo_dtype {
  KOLO_FLOAT32 = 0,
  KOLO_FLOAT64 = 1,
  KOLO_FLOAT16 = 2,  /* IEEE 754 binary16; reductions accumulate in float32 and round once */
  KOLO_BFLOAT16 = 3, /* bfloat16; reductions accumulate in float32 and round once */
  KOLO_INT8 = 4,
  KOLO_UINT8 = 5,
  KOLO_INT32 = 6,
  KOLO_INT64 = 7
} kolo_dtype_t;

typedef enum kolo_op {
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
  const char *secret;    /* NULL: KOLO_SECRET; the job secret every connection must prove */
  double timeout_s;      /* <= 0: KOLO_TIMEOUT (default 300); bound on every wait */
  int tcp_streams;       /* 0: KOLO_TCP_STREAMS (default 1); sockets per peer for data */
  const char *socket_ifname; /* NULL: KOLO_SOCKET_IFNAME; interface to listen on */
  uint64_t segment_bytes;    /* 0: KOLO_SEGMENT_BYTES (default 1 MiB); ring pipeline segment */
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
 * and connects to every peer. Blocks until all ranks have joined, or the timeout passes.
 *
 * On success *comm holds a new communicator that the caller owns and must pass to
 * kolo_comm_destroy(). On failure *comm is set to NULL and the status says why:
 * KOLO_ERR_INVALID_ARGUMENT (comm is NULL, or config has a wrong size or magic),
 * KOLO_ERR_CONFIG (no rank, size or address could be found: the message names the variable to
 * set), KOLO_ERR_TIMEOUT (some rank did not join in time), KOLO_ERR_SYSTEM (a socket could not be
 * opened). The message of a failed init is returned by kolo_comm_last_error(NULL).
 */
KOLO_API kolo_status_t kolo_comm_init(const kolo_config_t *config, kolo_comm_t *comm);

/*
 * Closes every connection and frees the communicator. Does not wait for other ranks and never
 * blocks for longer than it takes to close sockets. A broken communicator can be destroyed too.
 * Passing NULL returns KOLO_ERR_INVALID_ARGUMENT. The handle is invalid afterwards.
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
 * failed. The string belongs to kolo and stays valid until the next call on the same communicator
 * (or, for NULL, the next kolo_comm_init on this thread).
 */
KOLO_API const char *kolo_comm_last_error(kolo_comm_t comm);

/* ---- Collectives --------------------------------------------------------------------------- */

/*
 * Reduces count elements of dtype from every rank's sendbuf with op and writes the result to every
 * rank's recvbuf. sendbuf == recvbuf reduces in place. Buffers stay owned by the caller; kolo
 * reads sendbuf and writes recvbuf only during the call. Blocks until done.
 *
 * The result is bitwise identical on every rank and in every run for the same inputs. Uses the
 * ring algorithm: reduce-scatter then allgather, each rank sending 2(N-1)/N of the buffer.
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

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KOLO_H */

"""Communicators and request handles over the C ABI, for numpy arrays and raw buffers.

A Communicator wraps one kolo_comm_t. Its methods come in two layers:
  - the numpy methods (allreduce, allreduce_, broadcast, ..., allreduce_async, ...), which check
    and convert arrays and return new arrays or handles;
  - the raw methods (raw_allreduce, ...), which take addresses, element counts and kolo dtype
    numbers and are what kolo.torch builds on.
Every call of either layer blocks as its C function does (documented per method) and releases the
GIL while it runs in libkolo. Failures raise the KoloError subclass of the returned status with
kolo's message.
"""

import collections
import ctypes
import itertools
import threading

import numpy as np

from . import _capi
from ._secret import secret_is_authenticating
from .errors import error_for, invalid

lib = _capi.lib

# Kolo's dtypes (kolo_dtype_t) and reduction operations (kolo_op_t).
FLOAT32, FLOAT64, FLOAT16, BFLOAT16, INT8, UINT8, INT32, INT64, INT16 = range(9)
SUM, AVG, MIN, MAX, PROD = range(5)
AVERAGE = AVG

DTYPE_NAMES = {FLOAT32: "float32", FLOAT64: "float64", FLOAT16: "float16",
               BFLOAT16: "bfloat16", INT8: "int8", UINT8: "uint8", INT32: "int32",
               INT64: "int64", INT16: "int16"}
OP_NAMES = {SUM: "sum", AVG: "avg", MIN: "min", MAX: "max", PROD: "prod"}

# What one kolo_elastic_update call did (kolo_elastic_update_t): changed (1 when ranks left or
# joined), leaving (1 on a rank whose slot the launcher removed), joined, left, old_size,
# new_size (0 on a leaving rank).
ElasticUpdate = collections.namedtuple(
    "ElasticUpdate", ["changed", "leaving", "joined", "left", "old_size", "new_size"])

_NUMPY_DTYPES = {np.dtype(np.float32): FLOAT32, np.dtype(np.float64): FLOAT64,
                 np.dtype(np.float16): FLOAT16, np.dtype(np.int8): INT8,
                 np.dtype(np.uint8): UINT8, np.dtype(np.int32): INT32,
                 np.dtype(np.int64): INT64, np.dtype(np.int16): INT16}


def kolo_dtype_of(array, dtype=None):
    """The kolo dtype number of a numpy array. numpy has no bfloat16: pass dtype=kolo.BFLOAT16
    (or "bfloat16") with a uint16 array holding the bit patterns. Raises InvalidArgumentError for
    a dtype kolo does not have."""
    if dtype is not None:
        if dtype in (BFLOAT16, "bfloat16"):
            if array.dtype != np.uint16:
                raise invalid(f"dtype bfloat16 needs a uint16 array of bit patterns, "
                              f"not {array.dtype}")
            return BFLOAT16
        if isinstance(dtype, str):
            dtype = {name: number for number, name in DTYPE_NAMES.items()}.get(dtype, dtype)
        if dtype not in DTYPE_NAMES:
            raise invalid(f"unknown kolo dtype {dtype!r}; kolo has {sorted(DTYPE_NAMES.values())}")
        if dtype != _NUMPY_DTYPES.get(array.dtype):
            raise invalid(f"dtype {DTYPE_NAMES[dtype]} given for an array of {array.dtype}")
        return dtype
    number = _NUMPY_DTYPES.get(array.dtype)
    if number is None:
        raise invalid(f"arrays of {array.dtype} cannot be communicated: kolo has float32, "
                      f"float64, float16, int8, uint8, int16, int32, int64 (and bfloat16 as uint16 "
                      f"with dtype='bfloat16')")
    return number


def _check_op(op):
    if op not in OP_NAMES:
        raise invalid(f"unknown reduction op {op!r}; kolo has SUM, AVG, MIN, MAX, PROD "
                      f"(0..4)")
    return op


def _as_array(value, what="array"):
    if not isinstance(value, np.ndarray):
        raise invalid(f"{what} must be a numpy array, not {type(value).__name__}")
    return value


def _contiguous_input(array):
    return np.ascontiguousarray(_as_array(array))


def _writable(array, what="array"):
    _as_array(array, what)
    if not array.flags.c_contiguous:
        raise invalid(f"{what} must be C-contiguous to be written in place")
    if not array.flags.writeable:
        raise invalid(f"{what} is read-only and cannot be written in place")
    return array


def _address(array):
    return array.ctypes.data if array.size else None


def _u64_array(values):
    return (ctypes.c_uint64 * len(values))(*values)


def _rows(array):
    """(first dimension, elements per row) of an array; a 0-d array is one row of one element."""
    if array.ndim == 0:
        return 1, 1
    return array.shape[0], int(np.prod(array.shape[1:], dtype=np.int64))


class Handle:
    """A submitted named operation (kolo_request_t). poll() tells whether it has completed
    without blocking; wait() (alias synchronize()) blocks until it has, bounded by the
    communicator's timeout, and returns its result (the output array or tensor) or raises its
    KoloError. The buffers of the operation belong to kolo from submission until completion:
    the handle keeps them alive, and dropping a pending handle keeps them alive until kolo is
    done with them. A handle keeps its communicator alive; nothing the communicator holds refers
    back to a handle."""

    def __init__(self, comm, request, name, keep, result):
        self._comm = comm
        self._request = request
        self._keep = keep
        self._result = result
        self._error = None
        self._finished = False
        self.name = name

    def poll(self):
        """True once the operation has completed (successfully or not). Never blocks."""
        if self._finished:
            return True
        done = ctypes.c_int(0)
        status = lib.kolo_request_test(self._request, ctypes.byref(done))
        if done.value:
            self._finish(status)
        elif status != _capi.SUCCESS:
            self._finish(status)
        return self._finished

    def wait(self):
        """Blocks until the operation has completed, at most the communicator's timeout
        (KOLO_TIMEOUT; past it raises KoloTimeoutError and the operation stays pending). Returns
        the result; raises the operation's KoloError (MismatchError naming the tensor and the
        ranks, PeerLostError, CancelledError, ...)."""
        if not self._finished:
            status = lib.kolo_request_wait(self._request)
            if status == _capi.ERR_TIMEOUT:
                done = ctypes.c_int(0)
                lib.kolo_request_test(self._request, ctypes.byref(done))
                if not done.value:
                    raise error_for(status, self._message() or
                                    f"named operation '{self.name}' still pending after the "
                                    f"timeout")
            self._finish(status)
        if self._error is not None:
            raise self._error
        return self._complete()

    synchronize = wait

    def _message(self):
        text = lib.kolo_request_last_error(self._request)
        return text.decode(errors="replace") if text else ""

    def _finish(self, status):
        if status != _capi.SUCCESS:
            self._error = error_for(status, self._message())
        else:
            self._on_success()
        self._finished = True
        lib.kolo_request_free(self._request)
        self._request = None
        self._keep = None

    def _on_success(self):
        pass

    def _complete(self):
        return self._result

    def __del__(self):
        if getattr(self, "_request", None) is not None and not self._finished:
            # Still pending: kolo may still read and write the buffers. Hand them to the
            # communicator, which frees the request once it reports done.
            self._comm._requests.abandon(self._request, self._keep)


class _Requests:
    """The part of a Communicator that kolo's engine thread may reach: its kolo_comm_t (None once
    shut down) and the requests abandoned while pending, each with the buffers kept alive until
    kolo reports it done. It holds no reference to the Communicator, nor to any handle: a
    completion callback that ran Python on kolo's thread and held the last reference to a
    Communicator would run its __del__ (kolo_comm_destroy, which joins that thread) there, and a
    cycle through a handle would leave the Communicator to the garbage collector, which runs
    wherever Python next allocates, kolo's thread included."""

    def __init__(self, handle):
        self.handle = handle
        # abandon() may run on any thread, and again on this one from a __del__ that a garbage
        # collection started inside the lock
        self._lock = threading.RLock()
        self._abandoned = []

    def abandon(self, request, keep):
        """Takes over a pending request and its buffers; frees it at once if the communicator
        is already shut down (its requests are then done)."""
        with self._lock:
            if self.handle is not None:
                self._abandoned.append((request, keep))
                return
        lib.kolo_request_free(request)

    def reap(self):
        """Frees the abandoned requests that are done. Never blocks."""
        with self._lock:
            abandoned, self._abandoned = self._abandoned, []
        still = []
        for request, keep in abandoned:
            done = ctypes.c_int(0)
            lib.kolo_request_test(request, ctypes.byref(done))
            if done.value:
                lib.kolo_request_free(request)
            else:
                still.append((request, keep))
        with self._lock:
            self._abandoned.extend(still)

    def close(self):
        """Destroys the communicator (pending requests fail with CancelledError) and frees the
        abandoned requests. Calling it twice does nothing."""
        with self._lock:
            handle, self.handle = self.handle, None
        if handle is None:
            return
        lib.kolo_comm_destroy(handle)
        with self._lock:
            abandoned, self._abandoned = self._abandoned, []
        for request, _ in abandoned:
            lib.kolo_request_wait(request)
            lib.kolo_request_free(request)


class _AllgatherPhases:
    """The two phases of a named allgather, as kolo's engine thread runs them: shapes_done, the
    completion callback of the shape request, submits the data request as soon as every rank's
    rows are known. It refers to the communicator only through its _Requests, and to no handle:
    if the application has dropped the _AllgatherHandle by then, the data request is abandoned
    to the _Requests with its buffers."""

    def __init__(self, requests, name, array, dtype, make_output, size):
        self.requests = requests
        self.name = name
        self.array = array
        self.dtype = dtype
        self.make_output = make_output
        rows, per_row = _rows(array)
        self.shape_send = np.array([rows, per_row], dtype=np.int64)
        self.shapes = np.zeros(2 * size, dtype=np.int64)
        self.lock = threading.RLock()
        self.submitted = threading.Event()
        self.error = None
        self.data_request = None  # submitted, not yet taken by the handle
        self.output = None
        self.rows = None
        self.abandoned = False

    def shapes_done(self, status, _user_data):
        try:
            if status != _capi.SUCCESS:
                return
            shapes = self.shapes.reshape(-1, 2)
            per_row = shapes[:, 1]
            rows = shapes[:, 0]
            nonempty = per_row[rows > 0]
            if len(nonempty) and np.any(nonempty != nonempty[0]):
                ranks = ", ".join(f"rank {r}: {rows[r]} rows of {per_row[r]} elements"
                                  for r in range(len(rows)))
                self.error = error_for(_capi.ERR_MISMATCH,
                                       f"allgather '{self.name}': ranks send rows of different "
                                       f"sizes ({ranks}); all but the first dimension must "
                                       f"agree")
                return
            output = self.make_output(int(rows.sum()))
            handle = self.requests.handle
            if handle is None:
                self.error = error_for(_capi.ERR_CANCELLED, f"allgather '{self.name}': the "
                                       f"communicator was shut down")
                return
            request = ctypes.c_void_p()
            status = lib.kolo_allgather_async(handle, self.name.encode(), _address(self.array),
                                              self.array.size, _address(output), output.size,
                                              self.dtype, None, ctypes.byref(request))
            if status != _capi.SUCCESS:
                text = lib.kolo_comm_last_error(handle)
                self.error = error_for(status, text.decode(errors="replace") if text else "")
                return
            self.rows = rows.copy()
            with self.lock:
                if self.abandoned:
                    self.requests.abandon(request, (self.array, output))
                else:
                    self.data_request, self.output = request, output
        except BaseException as error:  # never let an exception reach kolo's thread
            self.error = error
        finally:
            self.submitted.set()

    def take_data_request(self):
        """(request, output) of the data phase once submitted and not yet taken, else None."""
        with self.lock:
            taken, self.data_request = self.data_request, None
        return None if taken is None else (taken, self.output)

    def abandon(self):
        """The handle is gone: a data request submitted later goes to the _Requests, and one
        submitted already but not taken is returned for the caller to abandon."""
        with self.lock:
            self.abandoned = True
            taken, self.data_request = self.data_request, None
        return taken


class _AllgatherHandle(Handle):
    """A named allgather whose total is unknown at submission: it first gathers every rank's
    (rows, elements per row) under `name + "/shape"`, and the completion callback of that request
    (on kolo's engine thread; _AllgatherPhases) submits the allgather of the data itself, so that
    every rank's data request is submitted as soon as the sizes are known, whatever the
    application does meanwhile, dropping this handle included.
    """

    def __init__(self, comm, name, array, dtype, make_output):
        self._comm = comm
        self.name = name
        self._finished = False
        self._error = None
        self._result = None
        self._data_handle = None
        self._phases = phases = _AllgatherPhases(comm._requests, name, array, dtype,
                                                 make_output, comm.size)
        callback = _capi.CALLBACK(phases.shapes_done)
        options = _capi.AsyncOptions(callback=callback)
        self._shape_handle = comm._submit_allgather(
            name + "/shape", phases.shape_send, 2, phases.shapes, 2 * comm.size, INT64, options,
            keep=(phases, callback, options))

    def _data(self):
        """The Handle of the data phase, once submitted (None before)."""
        if self._data_handle is None:
            taken = self._phases.take_data_request()
            if taken is not None:
                request, output = taken
                self._data_handle = Handle(self._comm, request, self.name,
                                           (self._phases.array, output), output)
        return self._data_handle

    def poll(self):
        """True once both phases have completed. Never blocks."""
        if self._finished:
            return True
        if not self._shape_handle.poll():
            return False
        if self._shape_handle._error is not None or self._phases.error is not None:
            return True
        data = self._data()
        return data is not None and data.poll()

    def wait(self):
        """As Handle.wait; returns the gathered array (the received rows of every rank in rank
        order)."""
        if not self._finished:
            try:
                self._shape_handle.wait()
                self._phases.submitted.wait()
                if self._phases.error is not None:
                    self._error = self._phases.error
                    raise self._error
                self._result = self._data().wait()
            finally:
                self._finished = True
        if self._error is not None:
            raise self._error
        return self._complete()

    synchronize = wait

    def rows_per_rank(self):
        """The first dimension each rank contributed (after wait())."""
        return [int(r) for r in self._phases.rows]

    def __del__(self):
        phases = getattr(self, "_phases", None)
        if phases is None:
            return
        taken = phases.abandon()
        if taken is not None:
            self._comm._requests.abandon(taken, (phases.array, phases.output))


class Communicator:
    """A group of ranks running collectives together: the world, from kolo.init(), or one made by
    split(). Collectives are called by every rank of the communicator, in the same order on every
    rank; named asynchronous operations may be submitted in any order. Thread-safe (collectives
    from several threads are serialised, and must still be issued in the same order on every
    rank). Call shutdown() to leave; a communicator the program drops is shut down then, by
    reference counting (handles refer to their communicator, nothing it holds refers back).

    peers_authenticated is True when the job has a secret that only its ranks know (passed to
    create(), or KOLO_SECRET or KOLO_SECRET_FILE, which kolorun sets), so that every peer proved
    it belongs to the job; False without a secret, or when secret_published is True (the secret
    went through torch's unauthenticated store). The collectives that unpickle what peers send
    (kolo.torch's broadcast_object, allgather_object, broadcast_optimizer_state, elastic sync)
    refuse to run without it. Communicators made by split() and shrink() inherit both."""

    def __init__(self, handle, peers_authenticated=False, secret_published=False):
        self.peers_authenticated = bool(peers_authenticated)
        self.secret_published = bool(secret_published)
        self._requests = _Requests(ctypes.c_void_p(handle))
        self._names = itertools.count()
        value = ctypes.c_int()
        self._check(lib.kolo_comm_rank(self._live(), ctypes.byref(value)))
        self.rank = value.value
        self._check(lib.kolo_comm_size(self._live(), ctypes.byref(value)))
        self.size = value.value
        self._check(lib.kolo_comm_local_rank(self._live(), ctypes.byref(value)))
        self.local_rank = value.value
        self._check(lib.kolo_comm_local_size(self._live(), ctypes.byref(value)))
        self.local_size = value.value

    @classmethod
    def create(cls, rank=None, size=None, local_rank=None, local_size=None, addr=None,
               secret=None, timeout=None, secret_published=False):
        """Joins the job (kolo_comm_init): every argument left None comes from the environment
        (KOLO_RANK, KOLO_SIZE, KOLO_ADDR, ... or a launcher's variables; see the README), and
        with none of them the process is a world of one (rank 0 of 1); a secret given here wins over KOLO_SECRET and KOLO_SECRET_FILE. secret_published: the
        secret was exchanged where others can read it (kolo's torch launch paths without
        KOLO_SECRET or KOLO_SECRET_FILE), so the communicator counts as unauthenticated
        (peers_authenticated False). Blocks until every rank has joined, at most the timeout.
        Raises ConfigError naming the variable to set, KoloTimeoutError, KoloSystemError."""
        config = _capi.Config()
        if rank is not None:
            config.rank = rank
        if size is not None:
            config.size = size
        if local_rank is not None:
            config.local_rank = local_rank
        if local_size is not None:
            config.local_size = local_size
        if addr is not None:
            config.addr = addr.encode()
        if secret is not None:
            config.secret = secret.encode() if isinstance(secret, str) else secret
        if timeout is not None:
            config.timeout_s = float(timeout)
        handle = ctypes.c_void_p()
        status = lib.kolo_comm_init(ctypes.byref(config), ctypes.byref(handle))
        if status != _capi.SUCCESS:
            message = lib.kolo_comm_last_error(None)
            raise error_for(status, message.decode(errors="replace") if message else "")
        return cls(handle.value,
                   peers_authenticated=secret_is_authenticating(secret) and not secret_published,
                   secret_published=secret_published)

    # ---- lifetime ------------------------------------------------------------------------------

    @property
    def closed(self):
        """True once shutdown() has been called."""
        return self._requests.handle is None

    def shutdown(self):
        """Closes the communicator (kolo_comm_destroy): pending named operations fail with
        CancelledError. Does not wait for other ranks. Calling it twice does nothing."""
        self._requests.close()

    def __del__(self):
        if getattr(self, "_requests", None) is not None:
            self.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _live(self):
        handle = self._requests.handle
        if handle is None:
            raise invalid("the communicator has been shut down")
        return handle

    def _check(self, status):
        if status != _capi.SUCCESS:
            handle = self._requests.handle
            text = lib.kolo_comm_last_error(handle) if handle is not None else b""
            raise error_for(status, text.decode(errors="replace") if text else "")

    def last_error(self):
        """kolo's message of the last failure on this communicator ("" if none)."""
        text = lib.kolo_comm_last_error(self._live())
        return text.decode(errors="replace") if text else ""

    # ---- raw collectives: addresses, counts, kolo dtype numbers -------------------------------

    def raw_allreduce(self, send, recv, count, dtype, op, prescale=1.0, postscale=1.0):
        """kolo_allreduce_scaled on raw addresses (send == recv: in place). Blocks."""
        if prescale == 1.0 and postscale == 1.0:
            self._check(lib.kolo_allreduce(self._live(), send, recv, count, dtype, op))
        else:
            self._check(lib.kolo_allreduce_scaled(self._live(), send, recv, count, dtype, op,
                                                  prescale, postscale))

    def raw_broadcast(self, buf, count, dtype, root):
        """kolo_broadcast on a raw address. Blocks."""
        self._check(lib.kolo_broadcast(self._live(), buf, count, dtype, root))

    def raw_allgatherv(self, send, recv, counts, dtype):
        """kolo_allgatherv on raw addresses with a count per rank. Blocks."""
        self._check(lib.kolo_allgatherv(self._live(), send, recv, _u64_array(counts), dtype))

    def raw_reduce_scatterv(self, send, recv, counts, dtype, op):
        """kolo_reduce_scatterv on raw addresses with a count per rank. Blocks."""
        self._check(lib.kolo_reduce_scatterv(self._live(), send, recv, _u64_array(counts),
                                             dtype, op))

    def raw_alltoall(self, send, recv, count, dtype):
        """kolo_alltoall on raw addresses: count elements to and from every rank. Blocks."""
        self._check(lib.kolo_alltoall(self._live(), send, recv, count, dtype))

    def raw_alltoallv(self, send, send_counts, recv, recv_counts, dtype):
        """kolo_alltoallv with blocks back to back in rank order on both sides. Blocks."""
        def displacements(counts):
            return (ctypes.c_int64 * len(counts))(*np.concatenate(
                [[0], np.cumsum(counts[:-1], dtype=np.int64)]).astype(np.int64).tolist())
        self._check(lib.kolo_alltoallv(self._live(), send, _u64_array(send_counts),
                                       displacements(send_counts), recv,
                                       _u64_array(recv_counts), displacements(recv_counts),
                                       dtype))

    def raw_send(self, buf, count, dtype, peer, tag):
        """kolo_send. Blocks until the receiver has the data."""
        self._check(lib.kolo_send(self._live(), buf, count, dtype, peer, tag))

    def raw_recv(self, buf, count, dtype, peer, tag):
        """kolo_recv. Blocks until the data has arrived."""
        self._check(lib.kolo_recv(self._live(), buf, count, dtype, peer, tag))

    def barrier(self):
        """Returns once every rank has entered the barrier (kolo_barrier). Blocks."""
        self._check(lib.kolo_barrier(self._live()))

    # ---- numpy collectives -------------------------------------------------------------------

    def allreduce(self, array, op=SUM, prescale=1.0, postscale=1.0, dtype=None):
        """Returns a new array: the reduction with op (SUM, AVG, MIN, MAX, PROD) of every rank's
        array, each multiplied by prescale first and the result by postscale. Every rank passes
        the same shape and dtype. `array` is only read. Blocks until done. Raises
        MismatchError when ranks disagree, InvalidArgumentError for a bad op or dtype."""
        source = _contiguous_input(array)
        kind = kolo_dtype_of(source, dtype)
        result = np.empty_like(source)
        self.raw_allreduce(_address(source), _address(result), source.size, kind,
                           _check_op(op), prescale, postscale)
        return result

    def allreduce_(self, array, op=SUM, prescale=1.0, postscale=1.0, dtype=None):
        """allreduce in place: `array` (C-contiguous, writable) receives the result and is
        returned. Blocks until done."""
        target = _writable(array)
        kind = kolo_dtype_of(target, dtype)
        self.raw_allreduce(_address(target), _address(target), target.size, kind, _check_op(op),
                           prescale, postscale)
        return target

    def broadcast(self, array, root=0, dtype=None):
        """Returns a new array holding root's array on every rank; `array` gives the shape and
        dtype (its contents matter on root only) and is not written. Blocks until done."""
        result = np.array(_as_array(array), order="C", copy=True)
        return self.broadcast_(result, root, dtype)

    def broadcast_(self, array, root=0, dtype=None):
        """broadcast in place: root's array is copied into `array` on every other rank; returns
        it. Blocks until done. InvalidArgumentError for a root outside [0, size)."""
        target = _writable(array)
        kind = kolo_dtype_of(target, dtype)
        self.raw_broadcast(_address(target), target.size, kind, int(root))
        return target

    def allgather(self, array, dtype=None):
        """Returns a new array: every rank's array concatenated along the first dimension, in
        rank order. Ranks may pass different first dimensions (zero included); the other
        dimensions and the dtype must agree (else MismatchError on every rank). Blocks (two
        collectives: the shapes, then the data)."""
        return self.allgather_rows(array, dtype)[0]

    def allgather_rows(self, array, dtype=None):
        """allgather, returning (the gathered array, the first dimension of every rank)."""
        source = _contiguous_input(array)
        kind = kolo_dtype_of(source, dtype)
        rows, per_row = _rows(source)
        shapes = np.empty(2 * self.size, dtype=np.int64)
        mine = np.array([rows, per_row], dtype=np.int64)
        self._check(lib.kolo_allgather(self._live(), _address(mine), _address(shapes), 2, INT64))
        shapes = shapes.reshape(-1, 2)
        nonempty = shapes[shapes[:, 0] > 0, 1]
        if len(nonempty) and np.any(nonempty != nonempty[0]):
            ranks = ", ".join(f"rank {r}: {shapes[r, 0]} rows of {shapes[r, 1]} elements"
                              for r in range(self.size))
            raise error_for(_capi.ERR_MISMATCH, f"allgather: ranks send rows of different "
                                                f"sizes ({ranks})")
        total = int(shapes[:, 0].sum())
        trailing = source.shape[1:] if source.ndim else ()
        result = np.empty((total,) + tuple(trailing), dtype=source.dtype)
        self.raw_allgatherv(_address(source), _address(result),
                            [int(r) * per_row for r in shapes[:, 0]], kind)
        return result, [int(r) for r in shapes[:, 0]]

    def reduce_scatter(self, array, op=SUM, dtype=None):
        """Reduces every rank's array (same shape everywhere) with op and returns this rank's
        share of the first dimension as a new array: rank r gets rows [start_r, start_r + n_r),
        n_r = rows // size, plus one for the first rows % size ranks. Blocks until done."""
        source = _contiguous_input(array)
        kind = kolo_dtype_of(source, dtype)
        if source.ndim == 0:
            raise invalid("reduce_scatter needs an array of at least one dimension")
        counts = [n * _rows(source)[1] for n in split_rows(source.shape[0], self.size)]
        mine = split_rows(source.shape[0], self.size)[self.rank]
        result = np.empty((mine,) + source.shape[1:], dtype=source.dtype)
        self.raw_reduce_scatterv(_address(source), _address(result), counts, kind,
                                 _check_op(op))
        return result

    def alltoall(self, array, splits=None, dtype=None):
        """Sends splits[p] rows of array (blocks of the first dimension, in rank order) to rank
        p and returns (received, received_splits): the rows every rank sent here, in rank order,
        and how many came from each. splits None: the first dimension divided evenly (it must be
        a multiple of size). Blocks (two collectives: the splits, then the data)."""
        source = _contiguous_input(array)
        kind = kolo_dtype_of(source, dtype)
        if source.ndim == 0:
            raise invalid("alltoall needs an array of at least one dimension")
        rows, per_row = _rows(source)
        if splits is None:
            if rows % self.size:
                raise invalid(f"alltoall: the first dimension ({rows}) is not a multiple of "
                              f"the number of ranks ({self.size}); pass splits")
            splits = [rows // self.size] * self.size
        given = np.asarray(splits)
        if given.dtype.kind not in "iu":
            raise invalid(f"alltoall: splits must be integers (row counts), not {given.dtype}")
        splits = given.astype(np.int64).reshape(-1)
        if len(splits) != self.size or np.any(splits < 0) or splits.sum() != rows:
            raise invalid(f"alltoall: splits must be {self.size} non-negative row counts "
                          f"summing to the first dimension ({rows}), not {splits.tolist()}")
        received = np.empty(self.size, dtype=np.int64)
        self._check(lib.kolo_alltoall(self._live(), _address(splits), _address(received), 1,
                                      INT64))
        result = np.empty((int(received.sum()),) + source.shape[1:], dtype=source.dtype)
        self.raw_alltoallv(_address(source), [int(s) * per_row for s in splits],
                           _address(result), [int(r) * per_row for r in received], kind)
        return result, received

    def reduce(self, array, root=0, op=SUM, dtype=None):
        """Reduces every rank's array with op onto root: returns a new array on root, None on
        the other ranks. Blocks until done on this rank."""
        source = _contiguous_input(array)
        kind = kolo_dtype_of(source, dtype)
        result = np.empty_like(source) if self.rank == root else None
        self._check(lib.kolo_reduce(self._live(), _address(source),
                                    _address(result) if result is not None else None,
                                    source.size, kind, _check_op(op), int(root)))
        return result

    def send(self, array, peer, tag=0, dtype=None):
        """Sends array to rank peer, which calls recv with the same shape, dtype and tag.
        Blocks until the receiver has it; see kolo_send for the ordering rules."""
        source = _contiguous_input(array)
        self.raw_send(_address(source), source.size, kolo_dtype_of(source, dtype), int(peer),
                      int(tag))

    def recv(self, array, peer, tag=0, dtype=None):
        """Receives into `array` (C-contiguous, writable; its size and dtype must match the
        send) the next message rank peer sends here; returns array. Blocks until it arrives."""
        target = _writable(array)
        self.raw_recv(_address(target), target.size, kolo_dtype_of(target, dtype), int(peer),
                      int(tag))
        return target

    def split(self, color, key=None):
        """Splits this communicator (kolo_comm_split), a collective on it: ranks passing the same
        colour form a new Communicator ranked by key (default: their rank here); a negative
        colour (kolo.COLOR_NONE) joins none and returns None. Blocks until every rank has its new
        communicator."""
        new = ctypes.c_void_p()
        self._check(lib.kolo_comm_split(self._live(), int(color),
                                        self.rank if key is None else int(key),
                                        ctypes.byref(new)))
        return self._derived(new.value) if new.value else None

    def shrink(self):
        """Returns a new Communicator of the ranks of this one that are still alive, ranked in
        their order here (kolo_comm_shrink), for the survivors after a call failed with
        PeerLostError or KoloTimeoutError: every surviving rank calls it. This communicator is
        broken by the call (if it was not already; its pending named operations fail with
        PeerLostError) and stays to be shut down by the caller; shrink may be called on it again
        after an error. Blocks until the survivors have agreed and connected: up to the timeout
        while waiting for them, at most about three times it. Raises PeerLostError or
        KoloTimeoutError when this rank is left out or the rank coordinating the shrink died
        after deciding (call shrink again), and the other KoloErrors of kolo_comm_shrink."""
        new = ctypes.c_void_p()
        self._check(lib.kolo_comm_shrink(self._live(), ctypes.byref(new)))
        return self._derived(new.value)

    def invite(self):
        """On rank 0 only: the invitation (a str, kolo_comm_invite) for the next grow() of this
        communicator. Hand it to each new process in its environment as KOLO_INVITATION; there
        Communicator.create() (or kolo.init()) joins the growth. A later invite() replaces it;
        it serves one growth. Sends nothing and does not block. Raises InvalidArgumentError on
        other ranks."""
        text = ctypes.create_string_buffer(_capi.INVITATION_MAX)
        self._check(lib.kolo_comm_invite(self._live(), text, _capi.INVITATION_MAX))
        return text.value.decode()

    def grow(self, new_size):
        """Called by every rank of this communicator with the same new_size: returns a new
        Communicator of new_size ranks, this one's ranks first in their order, then the
        new_size - size processes that joined with rank 0's invitation (kolo_comm_grow). This
        communicator is broken afterwards (its calls and pending named operations fail with
        CancelledError) and stays to be shut down by the caller. Blocks until all have
        connected, at most about three times the timeout. Raises MismatchError when the ranks
        pass different sizes (this communicator then keeps working), KoloTimeoutError or
        PeerLostError when newcomers are missing or die while joining, and the other KoloErrors
        of kolo_comm_grow."""
        new = ctypes.c_void_p()
        self._check(lib.kolo_comm_grow(self._live(), int(new_size), ctypes.byref(new)))
        return self._derived(new.value)

    def elastic_update(self):
        """Applies what `kolorun --elastic` decided about this job's slots (kolo_elastic_update),
        a collective on this communicator: every rank calls it at the same point (kolo.torch
        .elastic: at each commit). Returns (update, new), update an ElasticUpdate. No change, no
        driver (KOLO_ELASTIC_ADDR unset) or a libkolo without kolo_elastic_update: changed 0 and
        new None, at once. On a rank whose slot was removed: leaving 1 and new None (shut this
        communicator down and exit with status 0). On the others: new is the new Communicator
        (the members that stay in their old order, then the newcomers); this one stays to be
        shut down by the caller. Blocks while rank 0 asks the driver and the new communicator
        connects, bounded by KOLO_TIMEOUT; raises the KoloError of kolo_elastic_update (a
        newcomer that died while joining, a driver out of reach)."""
        if not hasattr(lib, "kolo_elastic_update"):
            self._live()
            return ElasticUpdate(0, 0, 0, 0, self.size, self.size), None
        update = _capi.ElasticUpdate()
        new = ctypes.c_void_p()
        self._check(lib.kolo_elastic_update(self._live(), ctypes.byref(update),
                                            ctypes.byref(new)))
        result = ElasticUpdate(*(getattr(update, name) for name in ElasticUpdate._fields))
        return result, self._derived(new.value) if new.value else None

    def _derived(self, handle):
        """A Communicator for a handle made from this one, whose connections prove the same
        secret."""
        return Communicator(handle, self.peers_authenticated, self.secret_published)

    # ---- named asynchronous operations ----------------------------------------------------------

    def _name(self, name, kind):
        if name is None:
            return f"{kind}.noname.{next(self._names)}"
        if not isinstance(name, str) or not name:
            raise invalid(f"a name must be a non-empty string, not {name!r}")
        return name

    def _submitted(self, status, request, name, keep, result, handle_class=Handle):
        self._check(status)
        return handle_class(self, request, name, keep, result)

    def raw_allreduce_async(self, name, send, recv, count, dtype, op, prescale=1.0,
                            postscale=1.0, keep=None, result=None):
        """kolo_allreduce_async on raw addresses; returns a Handle whose wait() returns
        `result`. `keep` is held until the operation completes. name is a str or its UTF-8
        bytes. Does not block."""
        self._requests.reap()
        if prescale == 1.0 and postscale == 1.0:
            options = None
        else:
            options = _capi.AsyncOptions(prescale, postscale)
        request = ctypes.c_void_p()
        status = lib.kolo_allreduce_async(self._live(), name if isinstance(name, bytes)
                                          else name.encode(), send, recv, count, dtype, op,
                                          ctypes.byref(options) if options else None,
                                          ctypes.byref(request))
        if status != _capi.SUCCESS:
            self._check(status)
        return Handle(self, request, name, (keep, options), result)

    def raw_broadcast_async(self, name, buf, count, dtype, root, keep=None, result=None):
        """kolo_broadcast_async on a raw address; returns a Handle. Does not block."""
        self._requests.reap()
        request = ctypes.c_void_p()
        status = lib.kolo_broadcast_async(self._live(), name.encode(), buf, count, dtype,
                                          int(root), None, ctypes.byref(request))
        return self._submitted(status, request, name, keep, result)

    def raw_allreduce_group_async(self, names, sends, recvs, counts, dtype, op, prescale=1.0,
                                  postscale=1.0, keep=None, result=None):
        """kolo_allreduce_group_async on raw addresses: one request for all. Does not block."""
        self._requests.reap()
        n = len(names)
        encoded = [name.encode() for name in names]
        names_array = (ctypes.c_char_p * n)(*encoded)
        sends_array = (ctypes.c_void_p * n)(*sends)
        recvs_array = (ctypes.c_void_p * n)(*recvs)
        options = _capi.AsyncOptions(prescale, postscale)
        request = ctypes.c_void_p()
        status = lib.kolo_allreduce_group_async(self._live(), n, names_array, sends_array,
                                                recvs_array, _u64_array(counts), dtype, op,
                                                ctypes.byref(options), ctypes.byref(request))
        return self._submitted(status, request, names[0] if names else "", (keep, options),
                               result)

    def _submit_allgather(self, name, send, count, recv, capacity, dtype, options, keep):
        request = ctypes.c_void_p()
        status = lib.kolo_allgather_async(self._live(), name.encode(), _address(send), count,
                                          _address(recv), capacity, dtype,
                                          ctypes.byref(options) if options is not None else None,
                                          ctypes.byref(request))
        return self._submitted(status, request, name, keep, recv)

    def allreduce_async(self, array, name=None, op=SUM, prescale=1.0, postscale=1.0,
                        dtype=None):
        """Submits the allreduce of a copy of `array` under `name` (ranks may submit names in
        any order; None: an automatic name, which needs every rank to submit unnamed operations
        in the same order) and returns a Handle at once; its wait() returns a new array. Raises
        InvalidArgumentError (bad arguments, a name still pending) at once."""
        source = np.array(_as_array(array), order="C", copy=True)
        kind = kolo_dtype_of(source, dtype)
        return self.raw_allreduce_async(self._name(name, "allreduce"), _address(source),
                                        _address(source), source.size, kind, _check_op(op),
                                        prescale, postscale, keep=source, result=source)

    def allreduce_async_(self, array, name=None, op=SUM, prescale=1.0, postscale=1.0,
                         dtype=None):
        """allreduce_async in place: `array` (C-contiguous, writable) must be neither read nor
        written until the handle completes; wait() returns it."""
        target = _writable(array)
        kind = kolo_dtype_of(target, dtype)
        return self.raw_allreduce_async(self._name(name, "allreduce"), _address(target),
                                        _address(target), target.size, kind, _check_op(op),
                                        prescale, postscale, keep=target, result=target)

    def grouped_allreduce_async(self, arrays, names=None, op=SUM, prescale=1.0, postscale=1.0):
        """Submits the allreduce of copies of several arrays of one dtype as one group (one
        collective, one handle); wait() returns the list of new arrays."""
        copies = [np.array(_as_array(a), order="C", copy=True) for a in arrays]
        return self._group(copies, names, op, prescale, postscale)

    def grouped_allreduce_async_(self, arrays, names=None, op=SUM, prescale=1.0, postscale=1.0):
        """grouped_allreduce_async in place: wait() returns the arrays themselves."""
        return self._group([_writable(a) for a in arrays], names, op, prescale, postscale)

    def _group(self, arrays, names, op, prescale, postscale):
        if not arrays:
            raise invalid("a grouped allreduce needs at least one array")
        kinds = {kolo_dtype_of(a) for a in arrays}
        if len(kinds) != 1:
            raise invalid(f"a grouped allreduce needs arrays of one dtype, not "
                          f"{sorted(DTYPE_NAMES[k] for k in kinds)}")
        if names is None:
            base = self._name(None, "grouped_allreduce")
            names = [f"{base}.{i}" for i in range(len(arrays))]
        elif len(names) != len(arrays):
            raise invalid(f"{len(names)} names for {len(arrays)} arrays")
        addresses = [_address(a) for a in arrays]
        return self.raw_allreduce_group_async(list(names), addresses, addresses,
                                              [a.size for a in arrays], kinds.pop(),
                                              _check_op(op), prescale, postscale, keep=arrays,
                                              result=arrays)

    def broadcast_async(self, array, root=0, name=None, dtype=None):
        """Submits the broadcast of a copy of `array` from root under `name`; wait() returns the
        new array."""
        result = np.array(_as_array(array), order="C", copy=True)
        return self.broadcast_async_(result, root, name, dtype)

    def broadcast_async_(self, array, root=0, name=None, dtype=None):
        """broadcast_async in place: wait() returns `array`, which holds root's values."""
        target = _writable(array)
        kind = kolo_dtype_of(target, dtype)
        return self.raw_broadcast_async(self._name(name, "broadcast"), _address(target),
                                        target.size, kind, root, keep=target, result=target)

    def allgather_async(self, array, name=None, dtype=None):
        """Submits the allgather of `array` (first dimensions may differ between ranks) under
        `name`; wait() returns every rank's rows concatenated in rank order. Does not block;
        the data is submitted by kolo's engine thread once every rank's shape is known."""
        source = np.array(_as_array(array), order="C", copy=True)
        kind = kolo_dtype_of(source, dtype)
        trailing = tuple(source.shape[1:]) if source.ndim else ()
        self._requests.reap()
        return _AllgatherHandle(
            self, self._name(name, "allgather"), source, kind,
            lambda total: np.empty((total,) + trailing, dtype=source.dtype))

    # ---- the fusion engine ---------------------------------------------------------------------

    def fusion_stats(self):
        """The fusion engine's counters on this rank, as a dict. Never blocks."""
        stats = _capi.FusionStats()
        stats.struct_size = ctypes.sizeof(stats)
        self._check(lib.kolo_comm_fusion_stats(self._live(), ctypes.byref(stats)))
        return {name: getattr(stats, name) for name, _ in stats._fields_[1:]}

    def join(self):
        """kolo_join: this rank has no more named operations to submit (it ran out of data). The
        named operations the others submit meanwhile run with zeros for this rank (allgather: no
        elements; a broadcast from this rank fails). Blocks until every rank has joined (bounded
        by the timeout) and returns the rank that joined last, the same on every rank."""
        last = ctypes.c_int(-1)
        self._check(lib.kolo_join(self._live(), ctypes.byref(last)))
        return last.value

    def set_fusion_threshold(self, nbytes):
        """Sets the bytes one fused collective may hold (0: no fusion); rank 0's value counts.
        Never blocks."""
        self._check(lib.kolo_comm_set_fusion_threshold(self._live(), int(nbytes)))


def split_rows(rows, size):
    """How reduce_scatter divides `rows` among `size` ranks: rows // size each, one more for
    the first rows % size ranks."""
    base, extra = divmod(int(rows), size)
    return [base + (1 if r < extra else 0) for r in range(size)]

"""The torch.distributed backend "kolo": a ProcessGroup written in Python (torch 1.13 lets Python
subclasses implement allreduce, broadcast, allgather, barrier, reduce_scatter, send and recv),
on a kolo communicator of the group's own.

Rendezvous: torch hands the backend its store (torchrun's, or the one init_process_group made
at MASTER_ADDR:MASTER_PORT, which already listens on MASTER_PORT). Rank 0 of the group picks a
free port for kolo's own rendezvous store and publishes it in torch's store; every rank then
joins kolo there. The job secret is KOLO_SECRET or KOLO_SECRET_FILE, read by kolo's core, and
nothing about it enters torch's store, which does not authenticate. Only when neither is set
does rank 0 generate a secret and publish it in torch's store (a warning says so once): the job
still starts, but whoever reaches torch's port can read that secret, so the group's communicator
counts as unauthenticated (Communicator.peers_authenticated; kolo/_secret.py). torch's own object
collectives (broadcast_object_list, all_gather_object, ...) unpickle what arrives through this
backend's broadcast and allgather, which cannot tell their bytes from a tensor's: without
KOLO_SECRET or KOLO_SECRET_FILE they trust unauthenticated peers, as on torch's other backends.

allreduce and allreduce_coalesced are asynchronous, so that DistributedDataParallel's bucket
reductions overlap backpropagation: each tensor is submitted to kolo's fusion engine as a named
allreduce and the call returns at once with a Work whose torch future completes when kolo's
requests do. The name is "torch.allreduce.<call>.<tensor>", <call> counting this group's
allreduce calls: torch requires every rank to issue a group's collectives in the same order
(DDP's reducer launches its buckets in bucket order), so the same call has the same name on
every rank.

Completion: one waiter thread per group (started by the first allreduce) waits for the requests
in submission order, each wait a ctypes call that releases the GIL, and completes the future
(set_result with the tensors, or set_exception with kolo's KoloError, such as MismatchError
naming the tensor and the ranks). A completion callback on kolo's engine thread would save that
thread, but it would have to take the GIL to touch a torch future: the engine, which runs every
named collective of the communicator, would then wait behind whatever Python code holds the GIL,
and the future's own callbacks (torch's and the user's) would run on kolo's thread, where they
must neither block nor wait for a request. The waiter thread takes the GIL only to complete a
future, and nothing in torch waits for a future while holding the GIL: Work.wait and
Future.wait release it, and DDP's reducer waits for its buckets at the end of backward on the
autograd engine's thread, which runs without the GIL.

The Work is a Python subclass of torch's Work, so that work.wait() raises kolo's error (the Work
torch makes around a future returns normally from wait() even when the future failed). C++
holders of a Work call back into the Python object (DDP's reducer asks for the future right
after allreduce returns); the group keeps every pending Work and the last one returned alive,
so that those calls always find it.

Ordering: ordered kolo calls (broadcast, allgather, reduce_scatter, barrier, send, recv) run on
other connections than the named ones and complete inside the call. Each first waits until the
group's pending allreduces have completed, as torch's backends run a group's operations in
issue order: an allreduce is never overtaken by a later broadcast of the same tensor, and a
barrier returns after every earlier allreduce of the group has finished. (A future callback
running on the waiter thread cannot wait for the waiter: an ordered call from there does not
wait.) isend/irecv block like send/recv: two ranks that both isend before their irecv cannot
proceed (kolo's sends are synchronous; order such exchanges).

Failures and bounds: every wait is bounded by the group's timeout (init_process_group's, which
becomes the communicator's timeout in place of KOLO_TIMEOUT): a request still pending then
fails its Work with KoloTimeoutError (kolo keeps its buffers until the group is shut down). A
lost peer fails every pending request with PeerLostError at once. shutdown() destroys the
communicator, which fails every pending request with CancelledError, and stops the waiter
thread. The thread is a daemon, and is also stopped at exit before the interpreter finalizes
(a thread that touches a torch future during finalization can abort the process): it holds up
the exit only while a request is still pending, at most 5 s.
"""

import collections
import os
import socket
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from .._port import free_port
from .._secret import secret_through_torch_store
from ..communicator import Communicator, kolo_dtype_of
from ..errors import InvalidArgumentError, KoloTimeoutError, UnsupportedError
from ._convert import as_array, check_tensor

_OPS = {}


def _reduce_op(op):
    if not _OPS:
        from .. import communicator as c
        _OPS.update({dist.ReduceOp.SUM: c.SUM, dist.ReduceOp.MIN: c.MIN,
                     dist.ReduceOp.MAX: c.MAX, dist.ReduceOp.PRODUCT: c.PROD})
        if hasattr(dist.ReduceOp, "AVG"):
            _OPS[dist.ReduceOp.AVG] = c.AVG
    for key, value in _OPS.items():
        if op == key:
            return value
    raise UnsupportedError(f"the kolo backend reduces with SUM, AVG, MIN, MAX and PRODUCT, not "
                           f"{op}")


def _CompletedWork(result=None):
    """A Work whose operation has already finished (failures raise in the call itself): torch's
    own work around a completed future, so that C++ callers see wait() and get_future() of a
    finished operation without calling back into Python."""
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class _Completions:
    """The waiter thread of one process group and its queue. add() queues the kolo Handles of
    one call with its torch future and returns a ticket (1, 2, ...); the thread waits for each
    call's handles in ticket order (kolo_request_wait, the GIL released, bounded by the
    communicator's timeout) and completes its future. wait_for(ticket) blocks until that call
    has completed. The thread holds no reference to the process group, so that the group and
    its communicator can still be collected."""

    def __init__(self, timeout_s):
        self._timeout_s = timeout_s
        self._condition = threading.Condition()
        self._queue = collections.deque()
        self._issued = 0
        self._completed = 0
        self._stopping = False
        self._thread = None
        self._abandoned = []  # handles still pending after a timeout: kolo may use their buffers

    def add(self, handles, future, work):
        """Queues one call; `work` stays alive until its future is complete."""
        with self._condition:
            if self._stopping:
                raise InvalidArgumentError("the kolo process group has been shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kolo-process-group",
                                                daemon=True)
                self._thread.start()
                try:  # run before the interpreter finalizes, as for non-daemon threads
                    threading._register_atexit(self._stop_at_exit)
                except (AttributeError, RuntimeError):  # no such hook, or already exiting
                    pass
            self._issued += 1
            self._queue.append((handles, future, work))
            self._condition.notify_all()
            return self._issued

    def completed(self, ticket):
        """True once the call with this ticket has completed. Never blocks."""
        return self._completed >= ticket

    def wait_for(self, ticket, timeout_s=None):
        """Blocks until the call with this ticket (None: the last one queued) has completed.
        Bounded: raises KoloTimeoutError when no call completes for the group's timeout (each of
        the waiter's waits is bounded by it, so that means the waiter is stuck), or when
        timeout_s (the caller's own bound) passes first."""
        if threading.current_thread() is self._thread:
            return  # a future callback on the waiter thread: it cannot wait for itself
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            ticket = self._issued if ticket is None else ticket
            while self._completed < ticket:
                before = self._completed
                step = self._timeout_s + 10.0
                if deadline is not None:
                    step = min(step, deadline - time.monotonic())
                if step <= 0 or (not self._condition.wait(step) and
                                 self._completed == before):
                    raise KoloTimeoutError(
                        f"allreduce {ticket} of the kolo process group has not completed after "
                        f"{step if step > 0 else timeout_s:.0f} s "
                        f"({ticket - self._completed} pending on this rank)")

    def _run(self):
        while True:
            with self._condition:
                while not self._queue and not self._stopping:
                    self._condition.wait()
                if not self._queue:
                    return
                handles, future, work = self._queue[0]
            error = None
            for handle in handles:
                try:
                    handle.wait()
                except KoloTimeoutError as timeout:
                    self._abandoned.append(handle)
                    error = error or timeout
                except BaseException as failure:  # kolo's error, or anything unexpected
                    error = error or failure
            try:
                if error is None:
                    future.set_result(work._tensors)
                else:
                    future.set_exception(error)
            except RuntimeError:
                pass  # the application completed the future itself: nothing left to tell it
            finally:  # the thread goes on whatever happened: DDP waits for later futures
                with self._condition:
                    self._queue.popleft()
                    self._completed += 1
                    self._condition.notify_all()

    def stop(self):
        """Lets the thread end once its queue is empty. Never blocks: it runs from the group's
        finalizer too, at garbage collection or at exit, where a pending request (its wait
        bounded by the timeout) must not hold anything up."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()

    def _stop_at_exit(self):
        """At exit, before the interpreter finalizes. A daemon thread still running then may be
        inside torch's future code, which takes the GIL back in a C++ destructor (set_result
        releases it); once finalization has begun Python ends the thread there, and the C++
        runtime aborts the process. The thread ends as soon as its queue is empty; a request
        still pending at exit holds the exit up for at most 5 s."""
        self.stop()
        self._thread.join(5.0)

    def join(self):
        """Waits for the thread to end (after stop(), and after destroying the communicator,
        which completes every pending request), at most the group's timeout."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._timeout_s + 10.0)
        self._abandoned = []


class _KoloWork(dist.Work):
    """The Work of an asynchronous kolo operation: wait() blocks (GIL released) until the
    operation has completed, at most the group's timeout, and returns True or raises kolo's
    error; get_future() is the torch future that completes with the tensors."""

    def __init__(self, completions, tensors):
        super().__init__()
        self._completions = completions
        self._tensors = tensors
        self._future = torch.futures.Future()
        self._ticket = None

    def wait(self, timeout=None):
        """Blocks until done (timeout, a timedelta, bounds the wait further; torch's
        no-timeout is zero); returns True, or raises the operation's KoloError, or
        KoloTimeoutError."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        self._completions.wait_for(self._ticket, seconds if seconds else None)
        self._future.wait()  # complete: returns at once, or raises the operation's error
        return True

    def get_future(self):
        """The torch.futures.Future of the operation: its value is the list of tensors."""
        return self._future

    def is_completed(self):
        """True once the operation has completed, successfully or not. Never blocks."""
        return self._completions.completed(self._ticket)

    def result(self):
        """The tensors, once complete (raises the operation's error)."""
        return self._future.wait()


def _tensors(tensors, what):
    for tensor in tensors:
        check_tensor(tensor, what)
        if not tensor.is_contiguous():
            raise InvalidArgumentError(f"{what} must be contiguous for the kolo backend")
    return tensors


class ProcessGroupKolo(dist.ProcessGroup):
    """A torch.distributed process group on a kolo communicator. Made by
    torch.distributed.init_process_group("kolo") or new_group(backend="kolo"). allreduce and
    allreduce_coalesced return at once with a pending Work; every other operation first waits
    for them, then blocks until it has finished on this rank. Every wait is bounded by the
    timeout given to init_process_group; failures raise kolo's errors (MismatchError,
    PeerLostError, ...), from the call or from the Work's wait() and future."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        if rank == 0:
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            store.set("kolo/addr", f"{host}:{free_port()}")
        address = store.get("kolo/addr").decode()
        secret = secret_through_torch_store(store, "kolo/", rank == 0)
        self._comm = Communicator.create(rank=rank, size=size, addr=address, secret=secret,
                                         timeout=timeout_s, secret_published=secret is not None)
        self._completions = _Completions(timeout_s or 300.0)
        self._allreduce_calls = 0
        self._latest_work = None
        weakref.finalize(self, self._completions.stop)

    def getBackendName(self):
        """"kolo"."""
        return "kolo"

    _get_backend_name = getBackendName

    def allreduce(self, tensors, opts=None):
        """Reduces each tensor in place with opts.reduceOp (SUM, AVG, MIN, MAX, PRODUCT), as
        named kolo allreduces. Does not block: returns a pending Work (the tensors must not be
        touched until it has completed). Bad arguments raise here; a failure of the reduction
        (ranks that disagree, a lost peer, the timeout) raises from work.wait() and the future,
        on every rank."""
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        tensors = _tensors(tensors, "allreduce tensor")
        self._allreduce_calls += 1
        base = f"torch.allreduce.{self._allreduce_calls}"
        work = _KoloWork(self._completions, tensors)
        handles = []
        try:
            for i, tensor in enumerate(tensors):
                array, dtype = as_array(tensor)
                handles.append(self._comm.allreduce_async_(array, name=f"{base}.{i}", op=op,
                                                           dtype=dtype))
        finally:  # what was submitted stays with the waiter, which keeps its buffers alive
            if handles or not tensors:
                work._ticket = self._completions.add(handles, work._future, work)
                self._latest_work = work
        return work

    def allreduce_coalesced(self, tensors, opts=None):
        """As allreduce: one named allreduce per tensor, one Work for all."""
        return self.allreduce(tensors, opts)

    def _after_pending(self):
        """Waits until every allreduce issued so far has completed (their failures are theirs
        to report), so that an ordered call never overtakes them."""
        self._completions.wait_for(None)

    def broadcast(self, tensors, opts=None):
        """Copies opts.rootRank's tensors into every rank's, in place. Blocks until done."""
        self._after_pending()
        root = opts.rootRank if opts is not None else 0
        for tensor in _tensors(tensors, "broadcast tensor"):
            array, dtype = as_array(tensor)
            self._comm.broadcast_(array, root=root, dtype=dtype)
        return _CompletedWork(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """Fills output_tensors[i][r] with rank r's input_tensors[i] (same shapes on every
        rank). Blocks until done."""
        self._after_pending()
        for outputs, tensor in zip(output_tensors, _tensors(input_tensors, "allgather tensor")):
            if len(outputs) != self._comm.size:
                raise InvalidArgumentError(f"allgather needs {self._comm.size} output tensors, "
                                           f"not {len(outputs)}")
            gathered = torch.empty((self._comm.size,) + tuple(tensor.shape), dtype=tensor.dtype)
            send, dtype = as_array(tensor)
            receive, _ = as_array(gathered)
            self._comm.raw_allgatherv(send.ctypes.data if send.size else None,
                                      receive.ctypes.data if receive.size else None,
                                      [send.size] * self._comm.size,
                                      kolo_dtype_of(send, dtype))
            for r, output in enumerate(outputs):
                output.copy_(gathered[r])
        return _CompletedWork(output_tensors)

    def _allgather_base(self, output, input, opts=None):
        """allgather into one tensor of size x input's shape (rank order). Blocks."""
        self.allgather([list(output.chunk(self._comm.size))], [input], opts)
        return _CompletedWork(output)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """output_tensors[i] receives the reduction over the ranks of their
        input_tensors[i][rank]. Blocks until done."""
        self._after_pending()
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for output, inputs in zip(_tensors(output_tensors, "reduce_scatter output"),
                                  input_tensors):
            stacked = torch.stack([t.reshape(output.shape) for t in inputs]).contiguous()
            array, dtype = as_array(stacked)
            target, _ = as_array(output)
            self._comm.raw_reduce_scatterv(
                array.ctypes.data if array.size else None,
                target.ctypes.data if target.size else None, [output.numel()] * self._comm.size,
                kolo_dtype_of(array, dtype), op)
        return _CompletedWork(output_tensors)

    def barrier(self, opts=None):
        """Returns once every rank of the group has entered it."""
        self._after_pending()
        self._comm.barrier()
        return _CompletedWork()

    def send(self, tensors, dst_rank, tag=0):
        """Sends each tensor to dst_rank (kolo_send: blocks until the receiver has it)."""
        self._after_pending()
        for tensor in _tensors(tensors, "send tensor"):
            array, dtype = as_array(tensor)
            self._comm.send(array, dst_rank, tag=tag, dtype=dtype)
        return _CompletedWork()

    def recv(self, tensors, src_rank, tag=0):
        """Receives each tensor from src_rank (same shapes, dtype and tag). Blocks."""
        self._after_pending()
        for tensor in _tensors(tensors, "recv tensor"):
            array, dtype = as_array(tensor)
            self._comm.recv(array, src_rank, tag=tag, dtype=dtype)
        return _CompletedWork(tensors)

    def shutdown(self):
        """Closes the kolo communicator of the group (pending allreduces fail with
        CancelledError) and stops its waiter thread. Blocks at most the group's timeout."""
        self._comm.shutdown()
        self._completions.stop()
        self._completions.join()


def _create(store, rank, size, timeout):
    return ProcessGroupKolo(store, rank, size, timeout)


def register():
    """Registers "kolo" with torch.distributed (done by `import kolo.torch`; harmless twice)."""
    if "KOLO" not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend("kolo", _create)

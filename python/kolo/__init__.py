"""kolo for Python: collective communication on numpy arrays over kolo's C ABI (ctypes).

    import numpy as np, kolo
    kolo.init()                                   # from KOLO_* / launcher variables (kolorun)
    total = kolo.allreduce(np.ones(4, np.float32), op=kolo.SUM)
    handle = kolo.allreduce_async_(grad, name="fc.weight.grad", op=kolo.AVG)
    kolo.synchronize(handle)
    kolo.shutdown()

The module-level functions act on the world communicator made by init(); kolo.Communicator (from
kolo.init() or Communicator.split) has the same methods. libkolo is found through KOLO_LIBRARY, else
beside the installed package, else in the build tree of the checkout (build/capi/libkolo.so).
"""

import atexit
import os
import threading

from . import _capi
from ._port import free_port
from ._secret import secret_through_torch_store
from .communicator import (AVERAGE, AVG, BFLOAT16, DTYPE_NAMES, FLOAT16, FLOAT32, FLOAT64, INT8,
                           INT16, INT32, INT64, MAX, MIN, OP_NAMES, PROD, SUM, UINT8, Communicator,
                           Handle, split_rows)
from .errors import (CancelledError, ConfigError, InternalError, InvalidArgumentError,
                     KoloError, KoloSystemError, KoloTimeoutError, MismatchError, PeerLostError,
                     UnsupportedError)

COLOR_NONE = _capi.COLOR_NONE
library_path = _capi.library_path
__version__ = "{}.{}.{}".format(_capi.library_version // 10000, _capi.library_version // 100 % 100,
                                _capi.library_version % 100)

_world = None
_lock = threading.Lock()


class NotInitializedError(ValueError):
    """A kolo function that needs the world communicator was called before kolo.init()."""


def init(**config):
    """Joins the job and makes the world communicator, which it returns; a second call returns
    the same one. Keyword arguments (rank, size, local_rank, local_size, addr, secret, timeout)
    override the environment (KOLO_RANK, KOLO_SIZE, KOLO_ADDR, ..., or what kolorun, mpirun,
    srun or torchrun export). Under torchrun, when its agent serves a store at MASTER_PORT
    (TORCHELASTIC_USE_AGENT_STORE=True: the default static rendezvous), rank 0 publishes
    kolo's address in that store; the job secret comes from KOLO_SECRET or
    KOLO_SECRET_FILE (or `secret`) and never enters that store, and only when none is set does
    rank 0 generate one and publish it there, with a warning: the world then counts as
    unauthenticated (Communicator.peers_authenticated), since whoever reaches MASTER_PORT can
    read it. Under torchrun's other rendezvous (c10d, etcd) nothing serves MASTER_PORT, and
    the core's own reading applies: kolo's store at MASTER_ADDR (rank 0's host) and
    MASTER_PORT, the secret from KOLO_SECRET or KOLO_SECRET_FILE (without one the job is
    unauthenticated, with a warning). Blocks until every rank has joined, at most the timeout.
    Raises ConfigError naming the variable to set, KoloTimeoutError, KoloSystemError."""
    global _world
    with _lock:
        if _world is None or _world.closed:
            if "addr" not in config and not os.environ.get("KOLO_ADDR") and \
                    os.environ.get("TORCHELASTIC_RUN_ID") and \
                    os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                config.update(_torchrun_rendezvous(config.get("timeout"),
                                                   config.get("secret") is not None))
            _world = Communicator.create(**config)
        return _world


def _torchrun_rendezvous(timeout, own_secret):
    """Under torchrun's agent store, MASTER_PORT is taken by that store: rank 0 picks a free port
    for kolo's store and publishes it in torchrun's store, where the other ranks read it, and
    the secret is settled as _secret.secret_through_torch_store says. Returns the arguments for
    Communicator.create."""
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore
    except ImportError as error:
        raise ConfigError(f"launched by torchrun, whose store holds MASTER_PORT, but torch "
                          f"cannot be imported to share kolo's address ({error}): set "
                          f"KOLO_ADDR=host:port with another port") from None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise ConfigError("launched by torchrun, but MASTER_ADDR or MASTER_PORT is not set")
    store = TCPStore(host, int(port), is_master=False,
                     timeout=timedelta(seconds=float(timeout or
                                                     os.environ.get("KOLO_TIMEOUT", 300))))
    prefix = _torchrun_store_prefix()
    publisher = os.environ.get("RANK") == "0"
    if publisher:
        store.set(prefix + "addr", f"{host}:{free_port()}")
    arguments = {"addr": store.get(prefix + "addr").decode()}
    secret = secret_through_torch_store(store, prefix, publisher, own_secret)
    if secret is not None:
        arguments.update(secret=secret, secret_published=True)
    return arguments


def _torchrun_store_prefix():
    """The prefix of the keys kolo.init() sets in torchrun's store (one per run and restart)."""
    return "kolo/{}/{}/".format(os.environ["TORCHELASTIC_RUN_ID"],
                                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def is_initialized():
    """True between init() and shutdown()."""
    return _world is not None and not _world.closed


def world():
    """The world communicator. Raises NotInitializedError before init()."""
    if _world is None or _world.closed:
        raise NotInitializedError("kolo has not been initialised: call kolo.init() first")
    return _world


def shutdown():
    """Leaves the job: closes the world communicator (pending named operations fail with
    CancelledError). Does not wait for other ranks. Harmless when not initialised; also run at
    interpreter exit."""
    global _world
    with _lock:
        if _world is not None:
            _world.shutdown()
        _world = None


atexit.register(shutdown)


def shrink():
    """Replaces the world communicator by the ranks of it that are still alive
    (Communicator.shrink) and shuts the old one down; returns the new world, on which every
    later module-level call runs. Called by every surviving rank after a call on the world failed
    with PeerLostError or KoloTimeoutError; pending named operations of the old world fail with
    PeerLostError. Blocks while the survivors agree, at most about three times the timeout. On
    an error (this rank was left out, or the rank coordinating the shrink died: see
    Communicator.shrink) the old world stays, broken, and shrink() may be called again. Raises
    NotInitializedError before init()."""
    global _world
    with _lock:
        old = world()
        _world = old.shrink()
    old.shutdown()
    return _world


def _adopt_world(new_world):
    """Makes new_world (a Communicator that Communicator.elastic_update or grow made from the
    world) the world, and shuts the old world down. Returns new_world."""
    global _world
    with _lock:
        old = world()
        _world = new_world
    old.shutdown()
    return new_world


def rank():
    """This process's rank in the world communicator."""
    return world().rank


def size():
    """The number of ranks in the world communicator."""
    return world().size


def local_rank():
    """This process's rank among the ranks on its machine."""
    return world().local_rank


def local_size():
    """The number of ranks on this machine."""
    return world().local_size


def _forward(name):
    method = getattr(Communicator, name)

    def function(*args, **kwargs):
        return getattr(world(), name)(*args, **kwargs)

    function.__name__ = name
    function.__qualname__ = name
    function.__doc__ = (method.__doc__ or "") + "\n\nOn the world communicator (kolo.init())."
    return function


for _name in ("allreduce", "allreduce_", "broadcast", "broadcast_", "allgather",
              "reduce_scatter", "alltoall", "reduce", "send", "recv", "barrier", "split",
              "allreduce_async", "allreduce_async_", "grouped_allreduce_async",
              "grouped_allreduce_async_", "broadcast_async", "broadcast_async_",
              "allgather_async", "fusion_stats", "set_fusion_threshold"):
    globals()[_name] = _forward(_name)
del _name


def poll(handle):
    """True once the named operation of `handle` has completed. Never blocks."""
    return handle.poll()


def synchronize(handle):
    """Waits for the named operation of `handle` (bounded by KOLO_TIMEOUT) and returns its
    result; raises its KoloError."""
    return handle.wait()


__all__ = [
    "init", "is_initialized", "shutdown", "shrink", "world", "rank", "size", "local_rank",
    "local_size", "allreduce", "allreduce_", "broadcast", "broadcast_", "allgather",
    "reduce_scatter", "alltoall", "reduce", "send", "recv", "barrier", "split", "allreduce_async",
    "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_", "broadcast_async",
    "broadcast_async_", "allgather_async", "fusion_stats", "set_fusion_threshold", "poll",
    "synchronize", "Communicator", "Handle", "split_rows", "SUM", "AVG", "AVERAGE", "MIN",
    "MAX", "PROD", "FLOAT32", "FLOAT64", "FLOAT16", "BFLOAT16", "INT8", "UINT8", "INT16",
    "INT32", "INT64", "DTYPE_NAMES", "OP_NAMES", "COLOR_NONE", "KoloError", "InvalidArgumentError",
    "KoloTimeoutError", "PeerLostError", "MismatchError", "InternalError", "KoloSystemError",
    "ConfigError", "UnsupportedError", "CancelledError", "NotInitializedError",
]

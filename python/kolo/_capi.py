"""The C ABI of kolo (capi/kolo.h) seen through ctypes: finding libkolo, checking its version,
and declaring every function's argument and result types.

Everything here is private to the package. ctypes releases the GIL for the duration of every call
into libkolo, so a blocking collective never stops the other Python threads of the process.
"""

import ctypes
import os

# The C ABI this binding was written against (KOLO_VERSION_MAJOR / _MINOR in capi/kolo.h). A
# library of another major version, or of an older minor version, is refused at load.
ABI_MAJOR = 0
ABI_MINOR = 2
API_VERSION = 1  # KOLO_API_VERSION: the version of the structs below
CONFIG_MAGIC = 0x6B6F6C6F
COLOR_NONE = -1
INVITATION_MAX = 128  # KOLO_INVITATION_MAX: the longest invitation, its NUL included

# kolo_status_t
SUCCESS = 0
ERR_INVALID_ARGUMENT = 1
ERR_TIMEOUT = 2
ERR_PEER_LOST = 3
ERR_MISMATCH = 4
ERR_INTERNAL = 5
ERR_SYSTEM = 6
ERR_CONFIG = 7
ERR_UNSUPPORTED = 8
ERR_CANCELLED = 9

comm_t = ctypes.c_void_p
request_t = ctypes.c_void_p
status_t = ctypes.c_int
CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p)


class Config(ctypes.Structure):
    """kolo_config_t; field order and types as in capi/kolo.h."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("magic", ctypes.c_uint32),
        ("api_version", ctypes.c_uint32),
        ("rank", ctypes.c_int),
        ("size", ctypes.c_int),
        ("local_rank", ctypes.c_int),
        ("local_size", ctypes.c_int),
        ("addr", ctypes.c_char_p),
        ("secret", ctypes.c_char_p),
        ("timeout_s", ctypes.c_double),
        ("tcp_streams", ctypes.c_int),
        ("socket_ifname", ctypes.c_char_p),
        ("segment_bytes", ctypes.c_uint64),
    ]

    def __init__(self):
        """The values of KOLO_CONFIG_INITIALIZER: everything from the environment."""
        super().__init__(ctypes.sizeof(Config), CONFIG_MAGIC, API_VERSION, -1, -1, -1, -1,
                         None, None, 0.0, 0, None, 0)


class AsyncOptions(ctypes.Structure):
    """kolo_async_options_t."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("prescale", ctypes.c_double),
        ("postscale", ctypes.c_double),
        ("callback", CALLBACK),
        ("user_data", ctypes.c_void_p),
    ]

    def __init__(self, prescale=1.0, postscale=1.0, callback=None):
        super().__init__(ctypes.sizeof(AsyncOptions), prescale, postscale,
                         callback if callback is not None else CALLBACK(), None)


class ElasticUpdate(ctypes.Structure):
    """kolo_elastic_update_t: what one kolo_elastic_update call did."""

    _fields_ = [(name, ctypes.c_int) for name in
                ("changed", "leaving", "joined", "left", "old_size", "new_size")]


class FusionStats(ctypes.Structure):
    """kolo_fusion_stats_t."""

    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (name, ctypes.c_uint64) for name in (
            "cycles", "idle_sleeps", "tensors_submitted", "requests_completed",
            "requests_failed", "negotiated", "cache_hits", "collectives", "fused_collectives",
            "tensors_fused", "bytes_copied", "fusion_buffer_bytes", "autotune_updates",
            "autotune_settled", "fusion_threshold")
    ] + [("cycle_time_ms", ctypes.c_double)] + [
        (name, ctypes.c_uint64) for name in (
            "segment_bytes", "collective_ns", "copy_ns", "negotiation_ns")
    ]


_u64 = ctypes.c_uint64
_int = ctypes.c_int
_ptr = ctypes.c_void_p
_str = ctypes.c_char_p
_u64p = ctypes.POINTER(ctypes.c_uint64)
_i64p = ctypes.POINTER(ctypes.c_int64)
_intp = ctypes.POINTER(ctypes.c_int)

# name: (result type, argument types)
_SIGNATURES = {
    "kolo_version": (ctypes.c_int, []),
    "kolo_status_string": (_str, [status_t]),
    "kolo_dtype_size": (ctypes.c_size_t, [_int]),
    "kolo_comm_init": (status_t, [ctypes.POINTER(Config), ctypes.POINTER(comm_t)]),
    "kolo_comm_destroy": (status_t, [comm_t]),
    "kolo_comm_rank": (status_t, [comm_t, _intp]),
    "kolo_comm_size": (status_t, [comm_t, _intp]),
    "kolo_comm_local_rank": (status_t, [comm_t, _intp]),
    "kolo_comm_local_size": (status_t, [comm_t, _intp]),
    "kolo_comm_last_error": (_str, [comm_t]),
    "kolo_allreduce": (status_t, [comm_t, _ptr, _ptr, _u64, _int, _int]),
    "kolo_allreduce_scaled": (status_t, [comm_t, _ptr, _ptr, _u64, _int, _int,
                                         ctypes.c_double, ctypes.c_double]),
    "kolo_broadcast": (status_t, [comm_t, _ptr, _u64, _int, _int]),
    "kolo_barrier": (status_t, [comm_t]),
    "kolo_allgather": (status_t, [comm_t, _ptr, _ptr, _u64, _int]),
    "kolo_allgatherv": (status_t, [comm_t, _ptr, _ptr, _u64p, _int]),
    "kolo_reduce_scatter": (status_t, [comm_t, _ptr, _ptr, _u64, _int, _int]),
    "kolo_reduce_scatterv": (status_t, [comm_t, _ptr, _ptr, _u64p, _int, _int]),
    "kolo_alltoall": (status_t, [comm_t, _ptr, _ptr, _u64, _int]),
    "kolo_alltoallv": (status_t, [comm_t, _ptr, _u64p, _i64p, _ptr, _u64p, _i64p, _int]),
    "kolo_reduce": (status_t, [comm_t, _ptr, _ptr, _u64, _int, _int, _int]),
    "kolo_send": (status_t, [comm_t, _ptr, _u64, _int, _int, _int]),
    "kolo_recv": (status_t, [comm_t, _ptr, _u64, _int, _int, _int]),
    "kolo_comm_split": (status_t, [comm_t, _int, _int, ctypes.POINTER(comm_t)]),
    "kolo_comm_shrink": (status_t, [comm_t, ctypes.POINTER(comm_t)]),
    "kolo_comm_invite": (status_t, [comm_t, ctypes.c_char_p, ctypes.c_size_t]),
    "kolo_comm_grow": (status_t, [comm_t, _int, ctypes.POINTER(comm_t)]),
    "kolo_allreduce_async": (status_t, [comm_t, _str, _ptr, _ptr, _u64, _int, _int,
                                        ctypes.POINTER(AsyncOptions),
                                        ctypes.POINTER(request_t)]),
    "kolo_broadcast_async": (status_t, [comm_t, _str, _ptr, _u64, _int, _int,
                                        ctypes.POINTER(AsyncOptions),
                                        ctypes.POINTER(request_t)]),
    "kolo_allreduce_group_async": (status_t, [comm_t, _int, ctypes.POINTER(_str),
                                              ctypes.POINTER(_ptr), ctypes.POINTER(_ptr), _u64p,
                                              _int, _int, ctypes.POINTER(AsyncOptions),
                                              ctypes.POINTER(request_t)]),
    "kolo_allgather_async": (status_t, [comm_t, _str, _ptr, _u64, _ptr, _u64, _int,
                                        ctypes.POINTER(AsyncOptions),
                                        ctypes.POINTER(request_t)]),
    "kolo_request_counts": (status_t, [request_t, _u64p, _int]),
    "kolo_request_test": (status_t, [request_t, _intp]),
    "kolo_request_wait": (status_t, [request_t]),
    "kolo_request_last_error": (_str, [request_t]),
    "kolo_request_free": (status_t, [request_t]),
    "kolo_comm_fusion_stats": (status_t, [comm_t, ctypes.POINTER(FusionStats)]),
    "kolo_comm_set_fusion_threshold": (status_t, [comm_t, _u64]),
    "kolo_join": (status_t, [comm_t, _intp]),
    "kolo_allreduce_scaled_on_stream": (status_t, [comm_t, _ptr, _ptr, _u64, _int, _int,
                                                   ctypes.c_double, ctypes.c_double, _ptr]),
    "kolo_broadcast_on_stream": (status_t, [comm_t, _ptr, _u64, _int, _int, _ptr]),
    "kolo_stream_synchronize": (status_t, [comm_t, _ptr]),
    "kolo_comm_gpu_backend": (status_t, [comm_t, ctypes.POINTER(_str)]),
}

# Declared when the library has them; a caller checks hasattr(lib, name) first.
# kolo_elastic_update (kolorun --elastic's driver) is newer than the ABI version above.
_OPTIONAL_SIGNATURES = {
    "kolo_elastic_update": (status_t, [comm_t, ctypes.POINTER(ElasticUpdate),
                                       ctypes.POINTER(comm_t)]),
}


class LibraryNotFound(ImportError):
    """libkolo could not be loaded; the message lists every place that was tried."""


def candidate_paths():
    """Where libkolo.so is looked for, in order: KOLO_LIBRARY, the library directory that
    `meson install` recorded beside the installed package, the package's own directory (where
    `pip install .` puts libkolo.so), and the build tree of a source checkout (build/capi/ at the
    top of it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = []
    explicit = os.environ.get("KOLO_LIBRARY")
    if explicit:
        candidates.append(("KOLO_LIBRARY", explicit))
        return candidates
    try:
        from . import _install  # written by `meson install`
        candidates.append(("installed library directory",
                           os.path.join(_install.LIBDIR, "libkolo.so.0")))
    except ImportError:
        pass
    candidates.append(("inside the package", os.path.join(here, "libkolo.so")))
    checkout = os.path.dirname(os.path.dirname(here))
    candidates.append(("build tree of the checkout",
                       os.path.join(checkout, "build", "capi", "libkolo.so")))
    return candidates


def _load():
    tried = []
    for where, path in candidate_paths():
        if not os.path.exists(path):
            tried.append(f"{path} ({where}: no such file)")
            continue
        try:
            library = ctypes.CDLL(path)
        except OSError as error:
            tried.append(f"{path} ({where}: {error})")
            continue
        return library, path
    raise LibraryNotFound(
        "kolo: cannot load libkolo; tried " + "; ".join(tried) +
        ". Set KOLO_LIBRARY to the path of libkolo.so (build it with `sh scripts/build.sh`: "
        "build/capi/libkolo.so).")


def _declare(library, path):
    version = library.kolo_version
    version.restype = ctypes.c_int
    version.argtypes = []
    found = version()
    major, minor, patch = found // 10000, found // 100 % 100, found % 100
    if major != ABI_MAJOR or minor < ABI_MINOR:
        raise ImportError(
            f"kolo: {path} is libkolo {major}.{minor}.{patch}, but this Python package needs "
            f"the C ABI {ABI_MAJOR}.{ABI_MINOR} (same major version, minor at least "
            f"{ABI_MINOR}); point KOLO_LIBRARY at a matching libkolo.so")
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(library, name)
        function.restype = restype
        function.argtypes = argtypes
    for name, (restype, argtypes) in _OPTIONAL_SIGNATURES.items():
        function = getattr(library, name, None)
        if function is not None:
            function.restype = restype
            function.argtypes = argtypes
    return found


lib, library_path = _load()
library_version = _declare(lib, library_path)

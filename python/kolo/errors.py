"""kolo's exceptions: one KoloError subclass per kolo_status_t, carrying the status and kolo's
message (which names the operation, the ranks and, for named operations, the tensor)."""

from . import _capi


class KoloError(RuntimeError):
    """A kolo call failed. `status` is the kolo_status_t value (an int), `status_name` its name
    (such as "KOLO_ERR_MISMATCH"), `message` kolo's own message."""

    status = None

    def __init__(self, message, status=None):
        if status is not None:
            self.status = status
        self.message = message
        self.status_name = _STATUS_NAMES.get(self.status, "KOLO_ERR_UNKNOWN")
        super().__init__(f"{self.status_name}: {message}" if message else self.status_name)


class InvalidArgumentError(KoloError, ValueError):
    """KOLO_ERR_INVALID_ARGUMENT: a bad argument, refused before anything was sent; the
    communicator keeps working. Also a ValueError."""
    status = _capi.ERR_INVALID_ARGUMENT


class KoloTimeoutError(KoloError, TimeoutError):
    """KOLO_ERR_TIMEOUT: a wait ran past the communicator's timeout (KOLO_TIMEOUT)."""
    status = _capi.ERR_TIMEOUT


class PeerLostError(KoloError):
    """KOLO_ERR_PEER_LOST: a rank died or its connection broke; the message names it."""
    status = _capi.ERR_PEER_LOST


class MismatchError(KoloError):
    """KOLO_ERR_MISMATCH: ranks called different collectives, or passed different counts,
    dtypes, ops, roots or names; raised on every rank, naming the ranks (and the tensor)."""
    status = _capi.ERR_MISMATCH


class InternalError(KoloError):
    """KOLO_ERR_INTERNAL: a bug in kolo."""
    status = _capi.ERR_INTERNAL


class KoloSystemError(KoloError, OSError):
    """KOLO_ERR_SYSTEM: an operating-system call failed (bind, connect, memory)."""
    status = _capi.ERR_SYSTEM


class ConfigError(KoloError):
    """KOLO_ERR_CONFIG: the environment does not describe a usable job; the message names the
    variable to set."""
    status = _capi.ERR_CONFIG


class UnsupportedError(KoloError, NotImplementedError):
    """KOLO_ERR_UNSUPPORTED: valid, but not available in this build or on this machine."""
    status = _capi.ERR_UNSUPPORTED


class CancelledError(KoloError):
    """KOLO_ERR_CANCELLED: a named operation's communicator was shut down before it ran."""
    status = _capi.ERR_CANCELLED


_STATUS_NAMES = {
    _capi.ERR_INVALID_ARGUMENT: "KOLO_ERR_INVALID_ARGUMENT",
    _capi.ERR_TIMEOUT: "KOLO_ERR_TIMEOUT",
    _capi.ERR_PEER_LOST: "KOLO_ERR_PEER_LOST",
    _capi.ERR_MISMATCH: "KOLO_ERR_MISMATCH",
    _capi.ERR_INTERNAL: "KOLO_ERR_INTERNAL",
    _capi.ERR_SYSTEM: "KOLO_ERR_SYSTEM",
    _capi.ERR_CONFIG: "KOLO_ERR_CONFIG",
    _capi.ERR_UNSUPPORTED: "KOLO_ERR_UNSUPPORTED",
    _capi.ERR_CANCELLED: "KOLO_ERR_CANCELLED",
}

_CLASSES = {cls.status: cls for cls in (
    InvalidArgumentError, KoloTimeoutError, PeerLostError, MismatchError, InternalError,
    KoloSystemError, ConfigError, UnsupportedError, CancelledError)}


def error_for(status, message):
    """The exception for a kolo_status_t and its message (an unknown status gives a plain
    KoloError)."""
    cls = _CLASSES.get(status)
    if cls is None:
        return KoloError(message, status)
    return cls(message)


def invalid(message):
    """An InvalidArgumentError found by the Python side, before calling kolo."""
    return InvalidArgumentError(message)

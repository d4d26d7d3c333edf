"""Torch CPU tensors as numpy arrays that share their memory, so that kolo.torch reuses the
numpy communicator methods without copies. bfloat16 tensors travel as uint16 bit patterns with
kolo's bfloat16 dtype."""

import numpy as np
import torch

from .. import communicator as _kolo
from ..errors import InvalidArgumentError, UnsupportedError

# Every torch dtype kolo communicates, with kolo's dtype for it: the one table of kolo.torch.
KOLO_DTYPES = {torch.float32: _kolo.FLOAT32, torch.float64: _kolo.FLOAT64,
               torch.float16: _kolo.FLOAT16, torch.bfloat16: _kolo.BFLOAT16,
               torch.int8: _kolo.INT8, torch.uint8: _kolo.UINT8, torch.int16: _kolo.INT16,
               torch.int32: _kolo.INT32, torch.int64: _kolo.INT64}
_SUPPORTED = tuple(KOLO_DTYPES)


_SUPPORTED_SET = frozenset(_SUPPORTED)


def check_tensor(tensor, what="tensor"):
    """Raises for what kolo.torch cannot communicate: a non-tensor, a GPU tensor on a path kolo
    has no device call for, an unsupported dtype."""
    if type(tensor) is torch.Tensor and tensor.dtype in _SUPPORTED_SET and not tensor.is_cuda \
            and tensor.layout is torch.strided:
        return  # the common case, checked cheaply (it runs once per gradient and step)
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise UnsupportedError(
            f"{what} is on {tensor.device}: this kolo.torch operation takes CPU tensors "
            f"(kolo's device calls cover synchronous allreduce and broadcast only)")
    if tensor.dtype not in _SUPPORTED:
        raise InvalidArgumentError(
            f"{what} has dtype {tensor.dtype}; kolo communicates float32, float64, float16, "
            f"bfloat16, int8, uint8, int16, int32 and int64")
    if tensor.is_sparse:
        raise InvalidArgumentError(f"{what} is sparse; kolo communicates dense tensors")


def as_array(tensor):
    """(numpy view of tensor's memory, kolo dtype argument). The tensor must be contiguous for
    the view to be the tensor itself."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    return tensor.numpy(), None


def from_array(array, dtype):
    """A tensor sharing the memory of a numpy array made by kolo, with the torch dtype."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)

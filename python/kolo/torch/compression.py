"""Gradient compression for allreduce and DistributedOptimizer, as Horovod's: Compression.none
sends tensors as they are, Compression.fp16 sends floating-point tensors as float16 and casts the
result back."""

import torch


class Compressor:
    """compress(tensor) returns (tensor to send, context); decompress(tensor, context) returns
    the tensor in its original form."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, context):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, context):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes; float16's range and precision);
    other tensors unchanged."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, context):
        return tensor if context is None else tensor.type(context)


class Compression:
    """The compressors: Compression.none and Compression.fp16."""
    none = NoneCompressor
    fp16 = FP16Compressor

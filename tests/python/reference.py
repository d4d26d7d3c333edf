"""Inputs and independently computed results for the Python tests: every rank can compute every
other rank's input, and the expected result is computed with numpy in float64/int64, rounded
once to the dtype (as kolo's kernels round once)."""

import numpy as np

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod"]


def float32_to_bfloat16_bits(values):
    """Rounds float32 values to bfloat16 (to nearest, ties to even); returns uint16 bits."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(np.uint16)


def bfloat16_bits_to_float64(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32) \
        .astype(np.float64)


def storage_dtype(dtype):
    """The numpy dtype that holds a kolo dtype (bfloat16 as uint16 bit patterns)."""
    return np.uint16 if dtype == "bfloat16" else np.dtype(dtype)


def rank_input(rank, count, dtype, seed=0):
    """Rank `rank`'s input: small integers (exact in every dtype), as the storage dtype."""
    generator = np.random.default_rng(seed * 1000003 + rank * 7919 + count)
    low = 0 if dtype == "uint8" else -3
    values = generator.integers(low, 4, size=count).astype(np.float64)
    return from_float64(values, dtype)


def from_float64(values, dtype):
    """Exact or once-rounded conversion of float64 values to the storage of dtype (integers
    wrap as two's complement)."""
    if dtype == "bfloat16":
        return float32_to_bfloat16_bits(values.astype(np.float32))
    if np.dtype(dtype).kind in "iu":
        return values.astype(np.int64).astype(dtype)
    return values.astype(dtype)


def to_float64(array, dtype):
    if dtype == "bfloat16":
        return bfloat16_bits_to_float64(array)
    return array.astype(np.float64)


def reduce(inputs, op, dtype):
    """The reduction of the ranks' inputs (storage arrays) with op, as kolo defines it."""
    values = np.stack([to_float64(a, dtype) for a in inputs])
    n = len(inputs)
    integer = dtype not in ("float32", "float64", "float16", "bfloat16")
    if op == "sum":
        result = values.sum(axis=0)
    elif op == "avg":
        result = values.sum(axis=0) / n
        if integer:
            result = np.trunc(result)
    elif op == "min":
        result = values.min(axis=0)
    elif op == "max":
        result = values.max(axis=0)
    else:
        result = np.prod(values, axis=0)
    return from_float64(result, dtype)

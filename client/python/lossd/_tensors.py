"""Tensors on the wire: raw little-endian, row-major bytes with an explicit dtype beside them.

numpy has no bfloat16, so bfloat16 tensors are carried as uint16 arrays holding the bit patterns
(the upper 16 bits of the float32 with the same sign, exponent and leading mantissa bits).
"""
import hashlib

import numpy as np

from lossd.v1 import lossd_pb2 as pb

# dtype name -> (wire enum, numpy dtype of the bytes on the wire)
_WIRE_DTYPES = {
    "float32": (pb.DTYPE_FLOAT32, np.dtype("<f4")),
    "bfloat16": (pb.DTYPE_BFLOAT16, np.dtype("<u2")),
    "float16": (pb.DTYPE_FLOAT16, np.dtype("<f2")),
}
_NAME_OF_ENUM = {enum: name for name, (enum, _) in _WIRE_DTYPES.items()}

DTYPE_NAMES = tuple(_WIRE_DTYPES)


def check_dtype_name(name):
    if name not in _WIRE_DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return name


def wire_enum(name):
    return _WIRE_DTYPES[check_dtype_name(name)][0]


def dtype_name(enum):
    return _NAME_OF_ENUM.get(enum, "unspecified")


def numpy_dtype(name):
    """The numpy dtype that holds a wire dtype's values (uint16 bit patterns for bfloat16)."""
    return _WIRE_DTYPES[check_dtype_name(name)][1]


def as_wire_array(array):
    """(dtype name, C-contiguous little-endian array) for sending a float array.

    float32 and float16 travel as they are, float64 is rounded to float32, uint16 is taken as
    bfloat16 bit patterns, and so is an ml_dtypes bfloat16 array.
    """
    array = np.asarray(array)
    if array.dtype.name == "bfloat16" or array.dtype == np.uint16:
        name = "bfloat16"
    elif array.dtype == np.float16:
        name = "float16"
    elif array.dtype in (np.float32, np.float64):
        name = "float32"
    else:
        raise TypeError(f"expected a float32, float64, float16 or bfloat16 (uint16 bits) array, "
                        f"got {array.dtype}")
    if name == "bfloat16":
        array = array.view(np.uint16)
    return name, np.ascontiguousarray(array, dtype=numpy_dtype(name))


def from_wire(data, name, shape):
    """Raw wire bytes seen as an array of the given shape, read-only and without a copy: the
    callers assign it into the array they assemble, which is the one copy needed."""
    return np.frombuffer(data, dtype=numpy_dtype(name)).reshape(shape)


def float32_to_bfloat16_bits(values):
    """Rounds float32 values to bfloat16 (nearest, ties to even), as uint16 bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(is_nan, ((bits >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)


def bfloat16_bits_to_float32(bits):
    """The exact float32 values of bfloat16 bit patterns."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def weight_sha256(weight, dtype):
    """HeadInfo.weight_sha256 of W [V, H] stored as dtype ("float32", "bfloat16", "float16"):
    SHA-256 of "lossd-head-v1 <dtype> <V> <H>\\n" and W's bytes in that dtype. weight is a
    float array (rounded to dtype as the server stores it) or, for bfloat16, uint16 bits."""
    weight = np.asarray(weight)
    if weight.ndim != 2:
        raise ValueError(f"weight: expected a [vocab_size, hidden_size] array, got shape "
                         f"{weight.shape}")
    check_dtype_name(dtype)
    if dtype == "bfloat16" and weight.dtype != np.uint16:
        stored = float32_to_bfloat16_bits(weight)
    else:
        stored = np.ascontiguousarray(weight, dtype=numpy_dtype(dtype))
    digest = hashlib.sha256(f"lossd-head-v1 {dtype} {weight.shape[0]} {weight.shape[1]}\n"
                            .encode())
    digest.update(stored.tobytes())
    return digest.hexdigest()

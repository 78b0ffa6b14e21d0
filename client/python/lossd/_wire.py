"""Compute's tensor messages encoded and decoded by hand, so that rows cross from the caller's
array to gRPC and dL/dh from gRPC to the caller's array with one copy each.

Building a protobuf message copies its bytes fields in, serializing copies them again, and
parsing a response copies grad_hidden out of the received bytes: at 16384 x 2048 float32 rows
those copies alone held the Python client near 0.3 GB/s each way. The messages are plain
protobuf on the wire (lossd.proto's field numbers below); only the large bytes fields skip the
protobuf objects, and everything else still goes through them.
"""
import numpy as np

from lossd.v1 import lossd_pb2 as pb

# Field numbers of lossd.proto.
_REQUEST_START, _REQUEST_CHUNK = 1, 2                       # ComputeRequest oneof
_RESPONSE_RESULT, _RESPONSE_SUMMARY = 1, 2                  # ComputeResponse oneof
_RESULT_GRAD_HIDDEN = 10                                    # ComputeResult.grad_hidden
CHUNK_FIELDS = {"hidden": 1, "teacher_hidden": 2,           # ComputeChunk
                "teacher_top_k_tokens": 3, "teacher_top_k_logprobs": 4}

_VARINT, _LENGTH_DELIMITED = 0, 2


def _varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field, wire_type):
    return _varint((field << 3) | wire_type)


def encode_start(start):
    """The ComputeRequest carrying `start` (a pb.ComputeStart), serialized."""
    return pb.ComputeRequest(start=start).SerializeToString()


def encode_chunk(arrays):
    """The ComputeRequest carrying one ComputeChunk of `arrays` ({ComputeChunk field name:
    C-contiguous array of its rows}), serialized: the arrays' bytes are copied once, into the
    message itself."""
    return b"".join(encode_chunk_parts(arrays))


def encode_chunk_parts(arrays):
    """encode_chunk's message as the pieces that make it up, in order: the keys and lengths as
    bytes, the arrays as views of their own memory (no copy), for a writer that sends pieces."""
    parts = []
    inner = 0
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        view = memoryview(array).cast("B") if array.nbytes else memoryview(b"")
        header = _key(CHUNK_FIELDS[name], _LENGTH_DELIMITED) + _varint(view.nbytes)
        parts += [header, view]
        inner += len(header) + view.nbytes
    return [_key(_REQUEST_CHUNK, _LENGTH_DELIMITED) + _varint(inner), *parts]


def _read_varint(data, offset):
    value = shift = 0
    while True:
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, offset
        shift += 7


def _fields(data, start, end):
    """(field number, wire type, value start, value end) of each field in data[start:end]; a
    varint's value is its bytes, as are a fixed-size field's."""
    offset = start
    while offset < end:
        key, offset = _read_varint(data, offset)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, next_offset = _read_varint(data, offset)
        elif wire_type == _LENGTH_DELIMITED:
            length, offset = _read_varint(data, offset)
            next_offset = offset + length
        elif wire_type == 1:
            next_offset = offset + 8
        elif wire_type == 5:
            next_offset = offset + 4
        else:
            raise ValueError(f"a ComputeResponse with wire type {wire_type}")
        if next_offset > end:
            raise ValueError("a ComputeResponse cut short")
        yield field, wire_type, offset, next_offset
        offset = next_offset


class Result:
    """A ComputeResult: its small fields parsed (a pb.ComputeResult without grad_hidden) and its
    grad_hidden bytes as a view of the received message, not a copy; or, `placed`, grad_hidden
    None and its bytes already where the caller's `place` asked for them (split_result)."""
    __slots__ = ("message", "grad_hidden", "placed")

    def __init__(self, message, grad_hidden, placed=False):
        self.message = message
        self.grad_hidden = grad_hidden
        self.placed = placed


def split_result(head, length):
    """For a ComputeResponse of `length` bytes whose first bytes are `head`: (the pb.ComputeResult
    without grad_hidden, the offset of grad_hidden's bytes) when it is a result whose grad_hidden
    is its last field and starts within `head` (as the server writes them: small fields first),
    else None. The reader can then receive dL/dh straight where it goes."""
    try:
        key, offset = _read_varint(head, 0)
        if key != (_RESPONSE_RESULT << 3) | _LENGTH_DELIMITED:
            return None
        member_length, member_start = _read_varint(head, offset)
        if member_start + member_length != length:
            return None
        offset = member_start
        while offset < len(head):
            field_start = offset
            key, offset = _read_varint(head, offset)
            field, wire_type = key >> 3, key & 7
            if wire_type == _VARINT:
                _, offset = _read_varint(head, offset)
                continue
            if wire_type == 1 or wire_type == 5:
                offset += 8 if wire_type == 1 else 4
                continue
            if wire_type != _LENGTH_DELIMITED:
                return None
            value_length, value_start = _read_varint(head, offset)
            if field == _RESULT_GRAD_HIDDEN:
                if value_start + value_length != length or value_start > len(head):
                    return None
                return pb.ComputeResult.FromString(head[member_start:field_start]), value_start
            offset = value_start + value_length
    except IndexError:  # a varint cut by the end of head
        return None
    return None


def decode_response(data):
    """A ComputeResponse from its bytes: a pb.ComputeSummary, or a Result."""
    view = memoryview(data)
    for field, wire_type, start, end in _fields(view, 0, len(view)):
        if field == _RESPONSE_SUMMARY and wire_type == _LENGTH_DELIMITED:
            return pb.ComputeSummary.FromString(view[start:end])
        if field == _RESPONSE_RESULT and wire_type == _LENGTH_DELIMITED:
            grad_hidden = view[0:0]
            rest = []
            for inner_field, inner_type, value_start, value_end in _fields(view, start, end):
                if inner_field == _RESULT_GRAD_HIDDEN and inner_type == _LENGTH_DELIMITED:
                    grad_hidden = view[value_start:value_end]
                else:
                    # The key and value of every other field, as they came.
                    rest.append((inner_field, inner_type, value_start, value_end))
            message = pb.ComputeResult.FromString(_reassemble(view, rest))
            return Result(message, grad_hidden)
    raise ValueError("a ComputeResponse with neither result nor summary")


def _reassemble(view, fields):
    """The bytes of `fields` (from _fields) re-encoded: the small fields of a result."""
    out = bytearray()
    for field, wire_type, start, end in fields:
        out += _key(field, wire_type)
        if wire_type == _LENGTH_DELIMITED:
            out += _varint(end - start)
        out += view[start:end]
    return bytes(out)

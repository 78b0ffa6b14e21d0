#!/usr/bin/python3
"""Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/ (committed; rerun after
changing the input layout of a target). Seeds are valid inputs that reach deep into the code and a
few malformed ones that reach each kind of refusal; the fuzzer mutates from there.

Uses Debian's python3-protobuf and protoc (/usr/bin/python3: see PLATFORM.md)."""

import json
import pathlib
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

FUZZ_DIR = pathlib.Path(__file__).resolve().parent
REPO = FUZZ_DIR.parent


def load_proto_module():
    out = pathlib.Path(tempfile.mkdtemp(prefix="lossd-corpus-"))
    subprocess.run(["protoc", f"-I{REPO / 'proto'}", f"--python_out={out}", "lossd/v1/lossd.proto"],
                   check=True)
    sys.path.insert(0, str(out))
    from lossd.v1 import lossd_pb2
    return lossd_pb2, out


def write_corpus(target, seeds):
    folder = FUZZ_DIR / "corpus" / target
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for name, data in seeds.items():
        (folder / name).write_bytes(data)


# ---- fuzz_safetensors: whole files ----

def safetensors(header, data=b"", pad=True):
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def tiled(tensors, metadata=None):
    """A valid file from (name, dtype, shape, raw bytes) in data order."""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    return safetensors(header, data)


def safetensors_seeds():
    f32 = np.arange(6, dtype="<f4").tobytes()
    halves = np.array([1.0, -2.5, 65504.0, np.inf], dtype="<f2").tobytes()
    bf16 = struct.pack("<4H", 0x3F80, 0xC020, 0x7F80, 0x7FC1)  # 1, -2.5, inf, a NaN
    i64 = struct.pack("<2q", -1, 7)
    return {
        "f32_matrix": tiled([("w", "F32", [2, 3], f32)]),
        "every_converting_dtype": tiled(
            [("a", "F32", [6], f32), ("b", "BF16", [2, 2], bf16), ("c", "F16", [4], halves),
             ("d", "I64", [2], i64)], metadata={"format": "pt"}),
        "empty_and_scalar": tiled([("empty", "F32", [0, 4], b""), ("scalar", "F16", [], halves[:2])]),
        "no_tensors": safetensors({}),
        "bad_truncated": tiled([("w", "F32", [2, 3], f32)])[:-5],
        "bad_gap": safetensors({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, f32[:8]),
        "bad_overlap": safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, f32[:8]),
        "bad_shape": safetensors({"w": {"dtype": "BF16", "shape": [3, -1], "data_offsets": [0, 6]}}, bf16[:6]),
        "bad_json": struct.pack("<Q", 9) + b'{"w": [1,',
        "bad_header_length": struct.pack("<Q", 2**63) + b"{}",
    }


# ---- fuzz_compute_stream: script header, then length-prefixed ComputeRequest records ----

NEVER = 255
VOCAB, HIDDEN = 64, 8  # the fuzz target's head


def script(requests, cancel_from_read=NEVER, retire_before_read=NEVER, fail_from_write=NEVER,
           budget_units=63, result_units=255, head_dtype=0):
    out = bytes([cancel_from_read, retire_before_read, fail_from_write, budget_units, result_units, head_dtype])
    for request in requests:
        # Bytes as given: a message protobuf itself would not write.
        raw = request if isinstance(request, bytes) else request.SerializeToString()
        out += struct.pack("<H", len(raw)) + raw
    return out


def compute_stream_seeds(pb):
    rng = np.random.default_rng(7)

    def start(num_tokens, hidden_dtype=pb.DTYPE_FLOAT32, labels=None, token_weights=(), outputs=None,
              options=None, head_version=None):
        if labels is None:
            labels = [int(x) for x in rng.integers(0, VOCAB, num_tokens)]
        request = pb.ComputeRequest(start=pb.ComputeStart(
            head="h", num_tokens=num_tokens, hidden_size=HIDDEN, hidden_dtype=hidden_dtype, labels=labels,
            token_weights=token_weights, outputs=outputs, options=options))
        if head_version is not None:
            request.start.head_version = head_version
        return request

    def rows(n):
        return rng.standard_normal((n, HIDDEN)).astype("<f4").tobytes()

    def bf16_rows(n):  # the high halves of float32s: bfloat16 rounded toward zero
        return (np.frombuffer(rows(n), dtype="<u4") >> 16).astype("<u2").tobytes()

    def chunks(data, *row_counts, row_bytes=4 * HIDDEN):
        out, at = [], 0
        for n in row_counts:
            request = pb.ComputeRequest()
            request.chunk.hidden = data[at:at + n * row_bytes]
            out.append(request)
            at += n * row_bytes
        return out

    scores = pb.OutputSelection(token_loss=True, logprob=True, lse=True, entropy=True, argmax=True, top_k=3)
    training = pb.OutputSelection(token_loss=True, grad_hidden=True, grad_hidden_dtype=pb.DTYPE_FLOAT16,
                                  accumulate_grad_weight=True)
    shaped = pb.LossOptions(reduction=pb.REDUCTION_SUM, label_smoothing=0.1, z_loss_scale=1e-4,
                            logit_softcap=30.0, temperature=0.7, grad_scale=0.5, ignore_index=-1)
    nan_row = bytearray(rows(2))
    nan_row[4:8] = struct.pack("<f", float("nan"))

    return {
        "score_f32": script([start(4, outputs=scores)] + chunks(rows(4), 4)),
        "train_bf16_split": script(
            [start(6, pb.DTYPE_BFLOAT16, outputs=training, token_weights=[1, 0.5, -1, 2, 0, 1])]
            + chunks(bf16_rows(6), 1, 2, 3, row_bytes=2 * HIDDEN),
            budget_units=30, head_dtype=1),
        "train_many_chunks": script(
            [start(40, options=shaped, outputs=training, labels=[-1 if i % 5 == 0 else i % VOCAB for i in range(40)])]
            + chunks(rows(40), 7, 7, 7, 7, 7, 5),
            budget_units=40, result_units=8, head_dtype=2),
        "empty_call": script([start(0, outputs=pb.OutputSelection(accumulate_grad_weight=True))]),
        "cancelled_mid_stream": script([start(4, outputs=training)] + chunks(rows(4), 2, 2), cancel_from_read=2),
        "retired_mid_stream": script([start(4, outputs=training)] + chunks(rows(4), 2, 2), retire_before_read=2),
        "client_gone_at_results": script([start(4, outputs=scores)] + chunks(rows(4), 4), fail_from_write=0),
        # Write 0 holds the results (one engine chunk), write 1 the summary, sent after dL/dW is
        # committed.
        "client_gone_at_summary": script(
            [start(6, pb.DTYPE_BFLOAT16, outputs=training)] + chunks(bf16_rows(6), 3, 3, row_bytes=2 * HIDDEN),
            fail_from_write=1),
        "bad_nan_row": script([start(2, outputs=training)] + chunks(bytes(nan_row), 2)),
        "bad_second_start": script([start(2), start(2)] + chunks(rows(2), 2)),
        "bad_partial_row": script([start(2)] + chunks(rows(2)[:40], 1, 1)),
        "bad_missing_rows": script([start(3)] + chunks(rows(2), 2)),
        "bad_pinned_version": script([start(1, head_version=7)] + chunks(rows(1), 1)),
        "bad_label": script([start(2, labels=[3, VOCAB])] + chunks(rows(2), 2)),
        # A tag of field 0 at a message's end, and rows sent as a varint (chunk.hidden = 5): the
        # server's decoder must refuse what protobuf refuses, and may refuse more.
        "bad_zero_tag": script([start(2), b"\x00"] + chunks(rows(2), 2)),
        "bad_rows_not_bytes": script([start(2), b"\x12\x02\x08\x05"] + chunks(rows(2), 2)),
        # A chunk and then a start in one message: protobuf keeps the start alone.
        "bad_chunk_then_start": script(
            [start(2), chunks(rows(2), 2)[0].SerializeToString() + start(2).SerializeToString()]
            + chunks(rows(2), 2)),
        # A field 0 inside a chunk that a start after it clears: protobuf refuses the message.
        "bad_field_zero_in_cleared_chunk": script(
            [start(2), b"\x12\x02\x02\x00" + start(2).SerializeToString()] + chunks(rows(2), 2)),
    }


# ---- fuzz_compute_socket: a mode byte, then what the client sends on the Compute socket ----
MAGIC = 0x3153434C
ERROR_END, RESULT_FIRST, TOKEN, SMALL_ROW_OFFER = 1, 2, 4, 8


def frame(kind, payload=b"", magic=MAGIC, length=None):
    return struct.pack("<IIQ", magic, kind, len(payload) if length is None else length) + payload


def compute_socket_seeds(pb):
    def hello(token=""):
        return frame(pb.FRAME_HELLO, pb.ComputeSocketHello(token=token).SerializeToString())

    def call(rows=2, teacher=False, chunk_bytes=None):
        start = pb.ComputeRequest(start=pb.ComputeStart(head="h", num_tokens=rows, hidden_size=4,
                                                        hidden_dtype=pb.DTYPE_FLOAT32,
                                                        labels=[1] * rows))
        chunk = pb.ComputeRequest(chunk=pb.ComputeChunk(
            hidden=np.arange(rows * 4, dtype=np.float32).tobytes(),
            teacher_hidden=np.ones(rows * 4, dtype=np.float32).tobytes() if teacher else b""))
        return (frame(pb.FRAME_MESSAGE, start.SerializeToString())
                + frame(pb.FRAME_MESSAGE, chunk_bytes or chunk.SerializeToString())
                + frame(pb.FRAME_HALF_CLOSE))

    # A chunk whose rows come twice: protobuf keeps the second, the first may land in place.
    rows_twice = (b"\x12\x44" + b"\x0a\x20" + bytes(range(32)) + b"\x0a\x20"
                  + bytes(range(32, 64)))

    return {
        "two_calls": bytes([0]) + hello() + call() + call(3),
        "two_calls_with_results": bytes([RESULT_FIRST]) + hello() + call() + call(1),
        "failed_call_then_more": bytes([ERROR_END]) + hello() + call() + call(),
        "token": bytes([TOKEN]) + hello("t") + call(),
        "wrong_token": bytes([TOKEN]) + hello("u") + call(),
        "empty_call": bytes([0]) + hello() + frame(pb.FRAME_HALF_CLOSE),
        "hello_alone": bytes([0]) + hello(),
        "bad_magic": bytes([0]) + frame(pb.FRAME_HELLO, magic=0x20544547),
        "message_before_hello": bytes([0]) + call(),
        "oversized_message": bytes([0]) + hello() + frame(pb.FRAME_MESSAGE, length=1 << 40),
        "unknown_kind": bytes([0]) + hello() + frame(77),
        "half_close_with_bytes": bytes([0]) + hello() + frame(pb.FRAME_HALF_CLOSE, b"abc"),
        "cut_mid_frame": bytes([0]) + hello() + call()[:30],
        # Rows received straight where the call offers them (the target offers 4 KiB or 64 B).
        "rows_past_a_small_offer": bytes([SMALL_ROW_OFFER]) + hello() + call(20),
        "rows_beside_a_teacher": bytes([SMALL_ROW_OFFER]) + hello() + call(8, teacher=True),
        "rows_twice_in_a_chunk": bytes([SMALL_ROW_OFFER]) + hello() + call(2, chunk_bytes=rows_twice),
        "cut_inside_rows": bytes([0]) + hello() + call(40)[:200],
        # A second call's start where the first's half-close belongs.
        "no_half_close": bytes([0]) + hello() + call()[:-16] + call(),
        # Lanes on the one connection the target has: a call whose other lanes never join, a
        # lane no call claims (each waits the stream idle limit), and frames that do not parse.
        "lanes_that_never_join": bytes([0]) + hello() + frame(pb.FRAME_LANES, pb.ComputeSocketLanes(
            call_key=bytes(16), lanes=2).SerializeToString()) + call(),
        "join_nobody_claims": bytes([0]) + hello() + frame(pb.FRAME_JOIN, pb.ComputeSocketJoin(
            call_key=bytes(16), lane=1).SerializeToString()),
        "lanes_that_do_not_parse": bytes([0]) + hello() + frame(pb.FRAME_LANES, b"\xff\xff"),
        "join_mid_call": bytes([0]) + hello() + call()[:-16] + frame(pb.FRAME_JOIN, b""),
    }


def main():
    pb, proto_out = load_proto_module()
    try:
        write_corpus("fuzz_safetensors", safetensors_seeds())
        write_corpus("fuzz_compute_stream", compute_stream_seeds(pb))
        write_corpus("fuzz_compute_socket", compute_socket_seeds(pb))
    finally:
        shutil.rmtree(proto_out)


if __name__ == "__main__":
    main()

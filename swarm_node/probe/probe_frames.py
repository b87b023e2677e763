"""The probe's own frame code, the same layout as the node's (swarm_node/net/streams.py's
length prefix, swarm_node/wire/frames.py's frame), written again so that the probe
imports nothing from swarm_node: the status request it sends, the status answer it
reads and checks, the one-line verdict, and the varint of an identify record.

Pure and standard-library only but for msgpack, so that tests check it against the
node's codec without py-libp2p; ``libp2p_probe.py`` (the program) imports it."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import msgpack

STATUS_PROTOCOL = "/swarm-node/status/1.0.0"
PING_PROTOCOL = "/ipfs/ping/1.0.0"
IDENTIFY_PROTOCOL = "/ipfs/id/1.0.0"

WIRE_VERSION = 1
LENGTH_BYTES = 8  # stream framing: u64 big-endian length, then the frame
HEADER_LEN = struct.Struct("<I")  # frame: u32 little-endian header length, msgpack header, payload
DTYPE_SIZES = {"f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "u8": 1}
MAX_HEADER_BYTES = 64 * 1024
MAX_STATUS_BYTES = 64 * 1024
MAX_IDENTIFY_BYTES = 64 * 1024

SECURITY_NAMES = {"noise": "Noise", "tls": "TLS 1.3"}
STATUS_FIELDS = {"run_id": str, "spec_hash": str, "version": str, "peer_id": str, "stage": int,
                 "num_stages": int, "state": str, "inner_step": int, "outer_round": int,
                 "peers_per_stage": list}

Tensor = tuple[str, Sequence[int], bytes]  # dtype name, shape, raw little-endian bytes


class FrameError(ValueError):
    """Bytes that are not a valid frame of the node's codec."""


class ProbeFailure(Exception):
    """The check failed; the message is the one-line verdict."""


def length_prefixed(frame: bytes) -> bytes:
    """One stream message: u64 big-endian length, then the bytes."""
    return len(frame).to_bytes(LENGTH_BYTES, "big") + frame


def encode_frame(header: dict, tensors: Sequence[Tensor] = ()) -> bytes:
    """u32 LE header length | msgpack {"v": 1, **header, "tensors": [[dtype, shape], ...]} | raw bytes."""
    if "v" in header or "tensors" in header:
        raise ValueError("header keys 'v' and 'tensors' are reserved")
    specs = []
    for dtype, shape, raw in tensors:
        if dtype not in DTYPE_SIZES or len(raw) != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise ValueError(f"tensor {dtype}{list(shape)} does not match its {len(raw)} bytes")
        specs.append([dtype, list(shape)])
    head = msgpack.packb({"v": WIRE_VERSION, **header, "tensors": specs}, use_bin_type=True)
    return b"".join([HEADER_LEN.pack(len(head)), head, *(bytes(raw) for _, _, raw in tensors)])


def decode_frame(data: bytes | bytearray | memoryview) -> tuple[dict, list[tuple[str, tuple[int, ...],
                                                                                 bytes]]]:
    """The header (without "v" and "tensors") and each tensor as (dtype, shape, bytes)."""
    view = memoryview(data)
    if len(view) < HEADER_LEN.size:
        raise FrameError(f"frame of {len(view)} bytes is shorter than its length prefix")
    (head_len,) = HEADER_LEN.unpack_from(view)
    if head_len > MAX_HEADER_BYTES or head_len > len(view) - HEADER_LEN.size:
        raise FrameError(f"header length {head_len} exceeds the frame or the cap")
    try:
        header = msgpack.unpackb(view[HEADER_LEN.size:HEADER_LEN.size + head_len], raw=False,
                                 strict_map_key=True, max_array_len=100_000, max_map_len=256)
    except Exception as exc:  # msgpack raises many unrelated types for bad bytes
        raise FrameError(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(header,
                      dict) or header.get("v") != WIRE_VERSION or not isinstance(header.get("tensors"), list):
        raise FrameError(f"not a version-{WIRE_VERSION} frame header")
    header.pop("v")
    offset, tensors = HEADER_LEN.size + head_len, []
    for spec in header.pop("tensors"):
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0],
                                                                         str) and spec[0] in DTYPE_SIZES
                and isinstance(spec[1], list) and all(type(d) is int and 0 <= d < 2**32 for d in spec[1])):
            raise FrameError(f"bad tensor spec {spec!r}")
        nbytes = math.prod(spec[1]) * DTYPE_SIZES[spec[0]]
        if offset + nbytes > len(view):
            raise FrameError("the frame is shorter than its tensors")
        tensors.append((spec[0], tuple(spec[1]), bytes(view[offset:offset + nbytes])))
        offset += nbytes
    if offset != len(view):
        raise FrameError(f"{len(view) - offset} bytes after the last tensor")
    return header, tensors


def status_request() -> bytes:
    """The whole request a probe writes on a /swarm-node/status/1.0.0 stream."""
    return length_prefixed(encode_frame({"kind": "status"}))


def parse_status(frame: bytes) -> dict:
    """The fields of a status answer (the frame without its length prefix); raises
    ProbeFailure for a busy, refused or malformed answer."""
    if not frame:
        raise ProbeFailure("busy: the node is at its stream cap; try again in a moment")
    try:
        header, tensors = decode_frame(frame)
    except FrameError as exc:
        raise ProbeFailure(f"bad answer on {STATUS_PROTOCOL}: {exc}") from None
    if header.get("kind") != "status" or tensors:
        raise ProbeFailure(f"bad answer on {STATUS_PROTOCOL}: not a status frame")
    if header.get("ok") is not True:
        raise ProbeFailure(
            f"the node answered an error on {STATUS_PROTOCOL}: {str(header.get('error'))[:200]}"
        )
    for name, kind in STATUS_FIELDS.items():
        if not isinstance(header.get(name), kind) or isinstance(header.get(name), bool):
            raise ProbeFailure(f"bad answer on {STATUS_PROTOCOL}: field {name!r} is {header.get(name)!r}")
    return header


def verdict(report: dict) -> str:
    s = report["status"]
    return (
        f"OK: node {s['peer_id']} of run {s['run_id']!r} (spec {s['spec_hash']}), stage {s['stage']} of "
        f"{s['num_stages']}, {s['state']}, inner step {s['inner_step']}, round {s['outer_round']}, peers per "
        f"stage {s['peers_per_stage']}, swarm-node {s['version']}; ping {report['ping_ms']:.1f} ms over "
        f"{SECURITY_NAMES[report['security']]} + yamux"
    )


def decode_uvarint(data: bytes) -> tuple[int, int]:
    """An unsigned LEB128 varint (multiformats unsigned-varint): (value, bytes used)."""
    value = 0
    for i, byte in enumerate(data[:9]):
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, i + 1
    raise ValueError("bad varint")

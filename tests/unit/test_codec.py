"""Property tests for the tensor frame codec: round trips, and any bad bytes raise
ProtocolError (never another exception, never a huge allocation)."""

import random
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm_node.errors import ProtocolError
from swarm_node.wire import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.frames import DTYPES

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(list(DTYPES.values())))
    shape = draw(shapes)
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    high = 255 if dtype == torch.uint8 else 2**31 - 1
    return torch.randint(0, high, shape, generator=g, dtype=dtype)


headers = st.dictionaries(st.sampled_from(["kind", "id", "stage", "path", "note"]),
                          st.one_of(st.integers(-2**40, 2**40), st.text(max_size=20), st.booleans(),
                                    st.lists(st.integers(0, 99), max_size=5)), max_size=5)


@given(headers, st.lists(tensors(), max_size=5))
@settings(max_examples=300, deadline=None)
def test_round_trip(header, ts):
    got_header, got = decode_frame(encode_frame(header, ts))
    assert got_header == {"v": 1, **header}
    assert len(got) == len(ts)
    for a, b in zip(ts, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.int16) if a.dtype in (torch.float16, torch.bfloat16) else a,
                           b.view(torch.int16) if b.dtype in (torch.float16, torch.bfloat16) else b)


@given(st.binary(max_size=512))
@settings(max_examples=2000, deadline=None)
def test_random_bytes_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        decode_frame(data)


@given(headers, st.lists(tensors(), min_size=1, max_size=3), st.data())
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_frames_decode_or_raise_protocol_error(header, ts, data):
    frame = bytearray(encode_frame(header, ts))
    for _ in range(data.draw(st.integers(1, 4))):
        choice = data.draw(st.integers(0, 2))
        pos = data.draw(st.integers(0, len(frame) - 1))
        if choice == 0:
            frame[pos] = data.draw(st.integers(0, 255))
        elif choice == 1:
            del frame[pos:]
            if not frame:
                frame = bytearray(b"\0")
        else:
            frame[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        decode_frame(bytes(frame))
    except ProtocolError:
        pass


def _frame_with_specs(specs, payload=b""):
    head = msgpack.packb({"v": 1, "tensors": specs})
    return struct.pack("<I", len(head)) + head + payload


def test_huge_declared_shapes_are_refused_before_allocation():
    with pytest.raises(ProtocolError, match="cap"):
        decode_frame(_frame_with_specs([["f32", [2**31 - 1, 2**31 - 1]]]),
                     FrameLimits(max_payload_bytes=1 << 20))
    with pytest.raises(ProtocolError, match="payload"):
        decode_frame(_frame_with_specs([["f32", [1000]]], b"\0" * 16))


@pytest.mark.parametrize("specs", [[["f64", [1]]], [["f32", [-1]]], [["f32", [1.5]]], [["f32"]], ["f32"],
                                   [["f32", [1] * 9]], [[[1], [2]]], [[{"a": 1}, [2]]], [[None, [2]]]])
def test_bad_tensor_specs(specs):
    with pytest.raises(ProtocolError):
        decode_frame(_frame_with_specs(specs, b"\0" * 4))


def _junk(rng: random.Random, depth: int = 0):
    """A msgpack value of any type a hostile peer can send, nested."""
    kinds = [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.randint(-(2**63), 2**64 - 1),
        lambda: rng.choice([float("nan"), float("inf"), -0.0, rng.random()]),
        lambda: rng.choice(["f32", "f16", "bf16", "i64", "x", ""]),
        lambda: rng.randbytes(rng.randint(0, 8)),
    ]
    if depth < 3:
        kinds += [lambda: [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))],
                  lambda: {rng.choice(["v", "tensors", "kind", "a"]): _junk(rng, depth + 1)
                           for _ in range(rng.randint(0, 3))}]
    return rng.choice(kinds)()


def test_20k_hostile_headers_raise_only_protocol_errors():
    """Any msgpack value where the codec expects a version, a tensor list, a dtype name
    or dims (a list as a dtype once crashed the decoder with TypeError)."""
    rng = random.Random(15)
    for _ in range(20_000):
        header = {"v": rng.choice([1, 1, 1, _junk(rng)]), "kind": _junk(rng)}
        header["tensors"] = rng.choice([
            _junk(rng), [_junk(rng) for _ in range(rng.randint(0, 3))],
            [[_junk(rng), [_junk(rng) for _ in range(rng.randint(0, 3))]] for _ in range(rng.randint(1, 3))],
            [[rng.choice(["f32", "f16"]), [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]]]])
        head = msgpack.packb(header, use_bin_type=True)
        try:
            decode_frame(struct.pack("<I", len(head)) + head + rng.randbytes(rng.randint(0, 64)))
        except ProtocolError:
            pass


def test_wrong_version_and_oversized_header():
    head = msgpack.packb({"v": 99, "tensors": []})
    with pytest.raises(ProtocolError, match="version"):
        decode_frame(struct.pack("<I", len(head)) + head)
    with pytest.raises(ProtocolError, match="header length"):
        decode_frame(struct.pack("<I", 10**9) + b"\0" * 10)


def test_reserved_keys_and_unsupported_dtypes_are_refused_on_encode():
    with pytest.raises(ValueError):
        encode_frame({"tensors": 1})
    with pytest.raises(ValueError):
        encode_frame({}, [torch.zeros(2, dtype=torch.float64)])


def test_decoded_tensors_are_writable_copies():
    frame = encode_frame({}, [torch.ones(4)])
    _, (t,) = decode_frame(frame)
    t.add_(1)  # must not raise or alias the frame
    assert decode_frame(frame)[1][0].sum() == 4


record_values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                          st.text(max_size=100), st.lists(st.integers(), max_size=3))


@given(st.one_of(record_values, st.dictionaries(
    st.sampled_from(["stage", "spec_hash", "version", "state", "throughput", "queue", "inner_step",
                     "outer_round", "seeking", "loss", "tokens", "lost", "partner_rounds", "local_rounds",
                     "last_error", "junk"]), record_values, max_size=16)))
@settings(max_examples=3000, deadline=None)
def test_registry_records_parse_or_raise_protocol_error(raw):
    from swarm_node.wire.records import PeerRecord

    try:
        record = PeerRecord.from_wire(raw)
    except ProtocolError:
        return
    assert PeerRecord.from_wire(record.to_wire()) == record


def test_registry_record_round_trip():
    from swarm_node.wire.records import PeerRecord

    record = PeerRecord(stage=1, spec_hash="abc", version="0.1.0", throughput=12.5, loss=2.0, seeking=True,
                        lost=3, partner_rounds=4, local_rounds=1, last_error="round 4: no partner")
    assert PeerRecord.from_wire(record.to_wire()) == record
    with pytest.raises(ProtocolError):
        PeerRecord.from_wire({**record.to_wire(), "last_error": "x" * 1000})

"""Property-based fuzzing of every pure wire decoder and message check a peer's bytes
reach (tests/fuzzing.py has the strategies): whatever comes in decodes to something that
passes the checks a valid message passes, or raises the project's typed error, never
TypeError, ValueError, OverflowError, struct.error, msgpack's or json's own errors.

Decoders fuzzed elsewhere (kept there): the frame codec and registry records
(test_codec.py), blockwise codes (test_blockwise.py), activations (test_activation_codec.py),
outer payloads whole (test_outer_codec.py), refusal hints (test_refusal_hints.py), spec
records as text (test_spec_record.py), lane offers as bytes (inproc/test_lanes.py)."""

from __future__ import annotations

import asyncio
import json
import math
import struct

import msgpack
import pytest
import torch
from fuzzing import bent_map, bent_tensors, frames, fuzz_settings, mutated
from hypothesis import example, given
from hypothesis import strategies as st

from swarm_node.data.manifest import FORMAT, Manifest, file_entry
from swarm_node.data.shard_format import HEADER_BYTES, parse_header, shard_bytes
from swarm_node.errors import DataError, IncompatibleRun, Oversize, PeerRefused, ProtocolError, StreamClosed
from swarm_node.membership.reachability import _results
from swarm_node.net.dialback import MAX_ADDRESSES_CHECKED, _requested_ports
from swarm_node.net.lane_auth import TICKET_BYTES, TICKET_TTL_S, Offer
from swarm_node.net.pacing import Pacer, PacerConfig, _Window
from swarm_node.net.transport import read_length
from swarm_node.probe import probe_frames as probe
from swarm_node.spec import RunSpec
from swarm_node.spec_record import SpecRecord
from swarm_node.train.worker import tensor_digest
from swarm_node.wire.activations import ACTIVATION_CODECS, encode_activations
from swarm_node.wire.blockwise import BITS, BLOCK, Quantized, dequantize, dequantize_near, packed_bytes
from swarm_node.wire.frames import (
    DEFAULT_LIMITS,
    DTYPES,
    WIRE_VERSION,
    decode_frame,
    encode_frame,
    peek_header,
)
from swarm_node.wire.messages import (
    MAX_DEADLINE_S,
    MAX_SKETCH_SEED,
    OUTER_PARTS,
    PAIR_KINDS,
    answer_is_yes,
    check_fetch,
    check_forward_request,
    check_outer_header,
    check_pair_request,
    check_sketch_answer,
    check_sketch_request,
    check_state_chunk,
    check_state_counters,
    decode_gradient_answer,
    refusal,
)
from swarm_node.wire.outer_codec import OUTER_CODECS, OuterEncoder, decode_outer_part, part_tensors
from swarm_node.wire.records import PeerRecord

SPEC = "0123456789abcdef"
HIDDEN, VOCAB, BATCH, SEQ = 8, 32, 2, 4
GEN = torch.Generator().manual_seed(52)
ACTIVATIONS = torch.randn(BATCH, SEQ, HIDDEN, generator=GEN)
TARGETS = torch.randint(0, VOCAB, (BATCH, SEQ), dtype=torch.int32, generator=GEN)
CPU = torch.device("cpu")


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


# -- frames ------------------------------------------------------------------------------
@fuzz_settings(150)
@given(frames({"kind": "x", "round": 1}, [torch.ones(3), torch.zeros(2, 2, dtype=torch.int64)]))
def test_a_frames_header_is_read_or_refused_before_its_tensors(raw):
    try:
        header = peek_header(raw)
    except ProtocolError:
        return
    assert header["v"] == WIRE_VERSION and isinstance(header["tensors"], list)


@pytest.mark.parametrize("cap", [0, 10, 1 << 20])
@fuzz_settings(40)
@given(prefix=st.binary(max_size=12))
def test_a_length_prefix_is_within_the_cap_or_refused(cap, prefix):
    async def read():
        reader = asyncio.StreamReader()
        reader.feed_data(prefix)
        reader.feed_eof()
        return await read_length(reader, cap)

    try:
        length = asyncio.run(read())
    except (Oversize, StreamClosed) as exc:
        assert isinstance(exc, StreamClosed) == (len(prefix) < 8)
        return
    assert 0 <= length <= cap


# -- the forward hop -----------------------------------------------------------------------
@pytest.mark.parametrize("codec", ACTIVATION_CODECS)
@fuzz_settings(80)
@given(data=st.data())
def test_a_forward_request_fits_the_stage_or_is_a_protocol_error(codec, data):
    valid = [*encode_activations(ACTIVATIONS, codec), TARGETS]
    raw = data.draw(frames({"kind": "fwd", "spec": SPEC, "deadline_s": 5.0}, valid))
    try:
        header, tensors = decode_frame(raw)
        deadline_s, hidden, targets = check_forward_request(
            header, tensors, spec_hash=SPEC, hidden_size=HIDDEN, max_batch=4 * BATCH, max_seq=SEQ,
            vocab_size=VOCAB, default_deadline_s=10.0, codec=codec)
    except ProtocolError:
        return
    assert type(deadline_s) is float and 0 < deadline_s <= MAX_DEADLINE_S
    batch, seq = targets.shape
    assert 0 < batch <= 4 * BATCH and 0 < seq <= SEQ and targets.dtype == torch.int64
    assert int(targets.min()) >= 0 and int(targets.max()) < VOCAB
    assert hidden.shape == (batch, seq, HIDDEN) and hidden.dtype == torch.float32 and finite(hidden)


@pytest.mark.parametrize("codec", ACTIVATION_CODECS)
@fuzz_settings(80)
@given(data=st.data())
def test_a_gradient_answer_fits_what_was_sent_or_is_refused(codec, data):
    raw = data.draw(frames({"ok": True, "loss": 2.5}, encode_activations(ACTIVATIONS, codec)))
    try:
        grad, loss = decode_gradient_answer(raw, DEFAULT_LIMITS, ACTIVATIONS.shape, codec)
    except (ProtocolError, PeerRefused):
        return
    assert grad.shape == ACTIVATIONS.shape and grad.dtype == torch.float32 and finite(grad)
    assert type(loss) is float and math.isfinite(loss)


# -- control messages ------------------------------------------------------------------------
@fuzz_settings(150)
@given(frames({"kind": "propose", "spec": SPEC, "round": 3}))
def test_a_pairing_request_names_a_kind_and_a_round_or_is_refused(raw):
    try:
        kind, round_no = check_pair_request(raw, SPEC)
    except ProtocolError:
        return
    assert kind in PAIR_KINDS and (round_no is None or (type(round_no) is int and round_no >= 0))


@fuzz_settings(150)
@given(frames({"kind": "outer-fetch", "spec": SPEC, "round": 0, "part": "delta"}))
def test_an_outer_fetch_names_a_part_or_is_refused(raw):
    try:
        part = check_fetch(raw, SPEC)
    except ProtocolError:
        return
    assert part is None or part in OUTER_PARTS


@fuzz_settings(150)
@given(frames({"ok": False, "error": "busy", "seekers": ["QmA"], "ready_in_s": 1.0}))
@example(refusal("not-ready", ["QmA"], 3.0))
def test_a_control_answer_reads_as_yes_or_no_with_a_short_reason(raw):
    try:
        yes, why = answer_is_yes(raw)
    except ProtocolError:
        return
    assert type(yes) is bool and isinstance(why, str) and len(why) <= 200


@pytest.mark.parametrize("part", [None, *OUTER_PARTS])
@fuzz_settings(60)
@given(header=bent_map({"kind": "outer", "spec": SPEC, "round": 1, "part": "phi", "ok": True}))
def test_an_outer_header_is_the_part_expected_or_is_refused(part, header):
    try:
        check_outer_header(header, SPEC, part)
    except ProtocolError:
        return
    assert header["kind"] == "outer" and header["spec"] == SPEC and header.get("part") == part


# -- state and its witnesses -------------------------------------------------------------------
STATE_META = {"ok": True, "snapshot": "d" * 16, "chunk": 2, "num_chunks": 5, "inner_step": 40,
              "outer_round": 2,
              "last_round_step": 30, "num_tensors": 7}


@pytest.mark.parametrize("snap_id", [None, "d" * 16])
@fuzz_settings(80)
@given(meta=bent_map(STATE_META))
def test_a_state_chunks_numbering_is_checked(snap_id, meta):
    try:
        snapshot, num_chunks = check_state_chunk(meta, 2, snap_id)
    except ProtocolError:
        return
    assert isinstance(snapshot, str) and len(snapshot) <= 64 and (snap_id is None or snapshot == snap_id)
    assert type(num_chunks) is int and 0 < num_chunks <= 100_000


@fuzz_settings(150)
@given(meta=bent_map(STATE_META))
def test_a_donors_counters_are_whole_numbers_in_range_or_refused(meta):
    try:
        counters = check_state_counters(meta)
    except ProtocolError:
        return
    assert all(type(c) is int and 0 <= c < 10**12 for c in counters)


@fuzz_settings(150)
@given(header=bent_map({"kind": "sketch", "spec": SPEC, "seed": 12345, "buckets": 64}))
def test_a_sketch_request_names_a_seed_in_range_or_is_refused(header):
    try:
        seed = check_sketch_request(header, SPEC, 64)
    except ProtocolError:
        return
    assert type(seed) is int and 0 <= seed < MAX_SKETCH_SEED


@fuzz_settings(150)
@given(meta=bent_map({"ok": True, "inner_step": 5, "outer_round": 1, "round_steps": 2}),
       tensors=bent_tensors([torch.zeros(3, 4, 64), torch.ones(4)]))
def test_a_witnesses_sketch_fits_the_stage_or_is_refused(meta, tensors):
    try:
        counters, rows, spread = check_sketch_answer(meta, tensors, 4, 64)
    except ProtocolError:
        return
    assert all(type(c) is int and 0 <= c < 10**12 for c in counters)
    assert rows.shape == (3, 4, 64) and rows.is_floating_point() and finite(rows)
    assert spread is None or (spread.shape == (4,) and finite(spread) and bool((spread >= 0).all()))


# -- blockwise codes and outer payloads ------------------------------------------------------------
HUGE_STEP = 3e38  # a finite float32 step whose codes reach past float32's range


@fuzz_settings(150)
@given(bits=st.sampled_from(BITS), numel=st.integers(0, 600), data=st.data())
@example(bits=8, numel=4, data=None)  # codes 254 (+127 steps) of a step of 3e38: infinite values, once
def test_any_blockwise_code_of_a_fitting_length_decodes_to_finite_values_or_is_refused(bits, numel, data):
    if data is None:
        q = Quantized(torch.full((4,), 254, dtype=torch.uint8), torch.tensor([HUGE_STEP]), (4,), 8)
    else:
        codes = data.draw(st.binary(min_size=packed_bytes(numel, bits), max_size=packed_bytes(numel, bits)))
        steps = data.draw(st.lists(st.floats(width=32) | st.sampled_from([HUGE_STEP, 1e38, 1e-45]),
                                   min_size=-(-numel // BLOCK), max_size=-(-numel // BLOCK)))
        q = Quantized(torch.frombuffer(bytearray(codes), dtype=torch.uint8) if codes else
                      torch.zeros(0, dtype=torch.uint8), torch.tensor(steps, dtype=torch.float32), (numel,),
                      bits)
    try:
        out = dequantize(q)
    except ProtocolError:
        return
    assert out.shape == q.shape and out.dtype == torch.float32 and finite(out)


@fuzz_settings(150)
@given(bits=st.sampled_from(BITS), numel=st.integers(1, 600), scale=st.sampled_from([1e-3, 1.0, 1e6, 1e30]),
       data=st.data())
@example(bits=8, numel=4, scale=1.0, data=None)  # a step of 3e38 near our own values: infinite values, once
def test_any_near_code_decodes_to_finite_values_near_ours_or_is_refused(bits, numel, scale, data):
    if data is None:
        q = Quantized(torch.full((4,), 255, dtype=torch.uint8), torch.tensor([HUGE_STEP]), (4,), 8)
        ours = torch.full((4,), 1e38)
    else:
        codes = data.draw(st.binary(min_size=packed_bytes(numel, bits), max_size=packed_bytes(numel, bits)))
        steps = data.draw(st.lists(st.floats(width=32) | st.sampled_from([HUGE_STEP, 1e-45]),
                                   min_size=-(-numel // BLOCK), max_size=-(-numel // BLOCK)))
        q = Quantized(torch.frombuffer(bytearray(codes), dtype=torch.uint8), torch.tensor(steps), (numel,),
                      bits)
        ours = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * scale
    try:
        out = dequantize_near(q, ours)
    except ProtocolError:
        return
    assert out.shape == ours.shape and finite(out)


SHAPES = [torch.Size([3, 100]), torch.Size([7])]
OURS = [torch.randn(s, generator=GEN) for s in SHAPES]


def _wire_parts(name: str) -> dict[str, list[torch.Tensor]]:
    encoder = OuterEncoder(OUTER_CODECS[name])
    wire = encoder.encode(OURS, [torch.randn(s, generator=GEN) * 1e-2 for s in SHAPES])
    cut = part_tensors(encoder.codec, "phi", len(SHAPES))
    return {"phi": wire[:cut], "delta": wire[cut:]}


WIRE = {name: _wire_parts(name) for name in OUTER_CODECS}


@pytest.mark.parametrize("name", list(OUTER_CODECS))
@pytest.mark.parametrize("part", OUTER_PARTS)
@fuzz_settings(25)
@given(data=st.data())
def test_an_outer_part_fits_our_stage_or_is_refused(name, part, data):
    codec = OUTER_CODECS[name]
    tensors = data.draw(bent_tensors(WIRE[name][part]))
    try:
        values = decode_outer_part(tensors, SHAPES, codec, CPU, part, near=OURS)
    except ProtocolError:
        return
    assert [v.shape for v in values] == SHAPES and all(v.is_floating_point() for v in values)
    if (codec.phi_bits if part == "phi" else codec.delta_bits) is not None:
        assert all(finite(v) for v in values)  # blockwise values are finite by construction


# -- records the DHT carries -----------------------------------------------------------------------
@fuzz_settings(150)
@given(raw=bent_map(PeerRecord(stage=1, spec_hash=SPEC, version="0.1.0", loss=2.0,
                               seeking=True).compact_wire()))
def test_a_bent_registry_record_parses_to_a_record_that_round_trips_or_is_refused(raw):
    try:
        record = PeerRecord.from_wire(raw)
    except ProtocolError:
        return
    assert PeerRecord.from_wire(record.compact_wire()) == record


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                           | st.text(max_size=20), lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=3), max_leaves=8)
SPEC_DICT = json.loads(RunSpec().canonical_json())
HUGE_INT = "1" * 5000  # over Python's 4,300 digits for int(str): ValueError, not JSONDecodeError


@fuzz_settings(150)
@given(raw=bent_map(SPEC_DICT, json_values), nested=st.sampled_from(["", "method", "inner", "data"]),
       inner=st.data())
@example(raw=SPEC_DICT, nested="", inner=None)
def test_a_published_spec_of_any_json_parses_or_is_an_incompatible_run(raw, nested, inner):
    if inner is None:
        text = RunSpec().canonical_json().replace('"seq_len":', f'"seq_len":{HUGE_INT},"was":', 1)
    else:
        if nested and isinstance(raw.get(nested), dict):
            raw = {**raw, nested: inner.draw(bent_map(raw[nested], json_values))}
        text = json.dumps(raw)
    record = SpecRecord("r", text, RunSpec().spec_hash(), "0.0.1")
    try:
        spec = record.parse()
    except (IncompatibleRun, ProtocolError):
        return
    assert spec.spec_hash() == record.spec_hash


def _small_manifest() -> Manifest:
    shard = shard_bytes(torch.arange(600).numpy() % 256, 256)
    return Manifest(256, "u16", 1024, file_entry("tok.json", b"{}", 1024),
                    (file_entry("train-0.tok", shard, 1024, tokens=600),), (), ("http://mirror/x",))


MANIFEST = json.loads(_small_manifest().to_bytes())


@fuzz_settings(150)
@given(choice=st.integers(0, 3), data=st.data())
@example(choice=-1, data=None)  # nested 100,000 deep: RecursionError, once
@example(choice=-2, data=None)  # a 5,000-digit number: ValueError, once
def test_a_manifest_of_any_bytes_parses_or_is_a_data_error(choice, data):
    if choice == -1:
        raw = b"[" * 100_000
    elif choice == -2:
        raw = f'{{"format":"{FORMAT}","vocab_size":{HUGE_INT}}}'.encode()
    elif choice == 0:
        raw = data.draw(st.binary(max_size=200))
    elif choice == 1:
        raw = data.draw(mutated(_small_manifest().to_bytes()))
    else:
        bent = data.draw(bent_map(MANIFEST, json_values))
        if choice == 3 and isinstance(bent.get("train"), list) and bent["train"]:
            bent["train"] = [data.draw(bent_map(MANIFEST["train"][0], json_values))]
        raw = json.dumps(bent).encode()
    try:
        manifest = Manifest.from_bytes(raw)
    except DataError:
        return
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest and manifest.train


@fuzz_settings(150)
@given(head=st.one_of(st.binary(max_size=40), mutated(shard_bytes(torch.arange(10).numpy(),
                                                                  300)[:HEADER_BYTES])),
       file_bytes=st.integers(0, 2**40), vocab=st.sampled_from([None, 300, 2**16 + 1]))
def test_a_shard_header_agrees_with_its_file_or_is_a_data_error(head, file_bytes, vocab):
    try:
        dtype, vocab_size, count = parse_header(head, file_bytes, vocab_size=vocab)
    except DataError:
        return
    assert file_bytes == HEADER_BYTES + count * dtype.itemsize and (vocab is None or vocab_size == vocab)


# -- the small protocols: dial-back, lane offers, paced acknowledgements, the probe ------------------
@fuzz_settings(150)
@given(frames({"kind": "dialback", "ports": [31337, 31338]}))
def test_a_dial_back_request_names_a_few_tcp_ports_or_is_refused(raw):
    try:
        ports = _requested_ports(raw)
    except ProtocolError:
        return
    assert 0 < len(ports) <= MAX_ADDRESSES_CHECKED and len(set(ports)) == len(ports)
    assert all(type(p) is int and 0 < p < 65536 for p in ports)


@fuzz_settings(150)
@given(header=bent_map({"kind": "dialback", "ok": True, "observed": "/ip4/10.0.0.1",
                        "results": {"31337": None, "31338": "refused"}}))
def test_a_dial_back_answer_is_a_few_short_results_or_is_refused(header):
    from swarm_node.errors import PeerError

    try:
        results = _results(header)
    except PeerError:
        return
    assert len(results) <= MAX_ADDRESSES_CHECKED
    assert all(isinstance(k, str) and (v is None or (isinstance(v, str) and len(v) <= 200))
               for k, v in results.items())


@fuzz_settings(150)
@given(raw=bent_map({"port": 4001, "cert": b"c" * 32, "ticket": b"t" * TICKET_BYTES, "ttl": 600.0}))
def test_a_bent_lane_offer_is_an_offer_we_can_use_or_is_refused(raw):
    try:
        offer = Offer.from_wire(msgpack.packb(raw), "10.0.0.1", now=100.0)
    except ProtocolError:
        return
    assert 0 < offer.port < 65536 and len(offer.cert_sha256) == 32 and len(offer.ticket) == TICKET_BYTES
    assert 100.0 <= offer.expires_at <= 100.0 + TICKET_TTL_S


@fuzz_settings(150)
@given(acks=st.lists(st.tuples(st.integers(0, 2**64 - 1) | st.integers(0, 70_000),
                               st.integers(0, 2**64 - 1).map(lambda us: us / 1e6)), max_size=8),
       paced=st.booleans())
def test_acknowledgements_rise_within_what_was_sent_or_are_refused(acks, paced):
    now = [0.0]
    config = PacerConfig(chunk_bytes=16 << 10, initial_bytes=16 << 10, min_bytes=16 << 10)
    window = _Window(60_000, Pacer(config, clock=lambda: now[0]) if paced else None)
    for ack, read_at_s in acks:
        while n := window.room(16 << 10):
            window.wrote(n)
        before = window.acked
        now[0] += 0.01
        try:
            window.on_ack(ack, read_at_s)
        except ProtocolError:
            return
        assert before < window.acked <= window.sent
        if paced:
            assert config.min_bytes <= window.pacer.window_bytes <= config.max_bytes


STATUS = {"kind": "status", "ok": True, "run_id": "r", "spec_hash": SPEC, "version": "0.1.0",
          "peer_id": "QmA",
          "stage": 0, "num_stages": 2, "state": "training", "inner_step": 12, "outer_round": 1,
          "peers_per_stage": [1, 2]}


def _probe_frame(specs) -> bytes:
    head = msgpack.packb({"v": 1, **STATUS, "tensors": specs})
    return struct.pack("<I", len(head)) + head


@fuzz_settings(150)
@given(frames(STATUS, [torch.zeros(2)]))
@example(_probe_frame([[[1], [2]]]))  # a dtype that is a list: TypeError (unhashable), once
@example(_probe_frame([[{"a": 1}, [2]]]))
def test_the_probe_reads_a_status_answer_or_says_why_not(raw):
    try:
        fields = probe.parse_status(raw)
    except probe.ProbeFailure:
        return
    assert all(isinstance(fields[name], kind) for name, kind in probe.STATUS_FIELDS.items())


@fuzz_settings(120)
@given(data=st.data())
@example(data=None)  # a bf16 tensor: numpy has no bfloat16 (TypeError), once
def test_any_tensors_a_frame_carries_have_a_digest(data):
    """A donor's state chunks are hashed as they came (state/sync.py), before anything
    else looks at them: whatever dtype the frame codec lets through."""
    if data is None:
        tensors = [torch.ones(3, dtype=torch.bfloat16)]
    else:
        tensors = [torch.zeros(data.draw(st.lists(st.integers(0, 4), max_size=3)),
                               dtype=data.draw(st.sampled_from(list(DTYPES.values()))))
                   for _ in range(data.draw(st.integers(0, 4)))]
    _, decoded = decode_frame(encode_frame({}, tensors))
    digest = tensor_digest(decoded)
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert tensor_digest([t.clone() for t in decoded]) == digest



@fuzz_settings(100)
@given(values=st.dictionaries(st.text(max_size=8), st.one_of(st.binary(max_size=30), mutated(msgpack.packb(
    PeerRecord(stage=1, spec_hash=SPEC, version="0.1.0").compact_wire())), st.just(b"\xc1")), max_size=4))
# FormatError, once: the key unread
@example(values={"QmGood": msgpack.packb({"stage": 1}), "QmJunk": b"\xc1"})
def test_a_registry_key_read_near_its_replicas_keeps_the_entries_that_deserialize(values):
    """Anyone can store any bytes as an entry's value (a signature proves its writer, not
    its format): the other entries of the key must still be read."""
    from types import SimpleNamespace

    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils import ValueWithExpiration
    from hivemind.utils.serializer import MSGPackSerializer

    from swarm_node.net.near import _readable

    stored = DictionaryDHTValue()
    for subkey, raw in values.items():
        stored.store(subkey, raw, 1e12)
    node = SimpleNamespace(protocol=SimpleNamespace(record_validator=None, serializer=MSGPackSerializer))
    read = _readable(node, DHTID.generate(source="r/stage/1"), ValueWithExpiration(stored, 1e12)).value
    for subkey, raw in values.items():
        try:
            expected = MSGPackSerializer.loads(raw)
        except Exception:
            assert subkey not in read
            continue
        assert read[subkey].value == expected

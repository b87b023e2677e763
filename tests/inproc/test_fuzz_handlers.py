"""Property-based fuzzing of every protocol handler a peer can reach, and of every place
a peer's answer is read, as the node wires them (tests/inproc/parts.py fakes; strategies
in tests/fuzzing.py): a handler answers a frame with a boolean ``ok``, or closes, and
never raises; a malformed request is counted against its sender (a "malformed"
refusal); an answer is used only once it passed its checks, and otherwise raises the
project's typed error (PeerError, or gossip's Refused), never TypeError and the like.

tests/inproc/test_hostile_input.py throws 10,000 random frames at the six tensor
protocols and checks memory and logs; here hypothesis aims at the checks themselves."""

from __future__ import annotations

import asyncio
import socket
import types

import msgpack
import pytest
import torch
from fuzzing import bent_map, frames, fuzz_settings, mutated
from hivemind.utils.multiaddr import Multiaddr
from hypothesis import example, given
from hypothesis import strategies as st
from parts import FakeDHT, FakeP2P, Sink, StageParts, exchange_as_partner, framed, stream_to

from swarm_node.data.cache import ShardCache
from swarm_node.data.fetch import DataFetcher
from swarm_node.data.manifest import MANIFEST_FILE, Manifest, file_entry
from swarm_node.data.serve import DataServer, data_request
from swarm_node.data.shard_format import shard_bytes
from swarm_node.data.spec import DataSpec
from swarm_node.errors import PeerError, ProtocolError
from swarm_node.gossip.pairing import Refused
from swarm_node.membership.reachability import check_reachability
from swarm_node.membership.registry import stage_key
from swarm_node.membership.view import Membership
from swarm_node.net.dialback import dialback_handler
from swarm_node.net.guard import PeerGuard
from swarm_node.net.lane_auth import (
    ACCEPTED,
    CHALLENGE_BYTES,
    HELLO_BYTES,
    LANE_HELLO,
    PROOF_BYTES,
    LaneIdentity,
    Offer,
    Tickets,
    caller_proof,
    ticket_id,
)
from swarm_node.net.lanes import LanePool, LaneServer
from swarm_node.net.streams import read_frame
from swarm_node.net.transport import ServeLimits, Transport, write_frame
from swarm_node.node_config import NodeConfig
from swarm_node.obs.endpoints import handle_status_request
from swarm_node.obs.http import MAX_REQUEST_BYTES, Response, StatusServer
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.state.sketch import SKETCH_BUCKETS
from swarm_node.train.worker import StageWorker
from swarm_node.wire.activations import encode_activations
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.messages import refusal
from swarm_node.wire.records import PeerRecord

SPEC = RunSpec(run_id="fuzz", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))
HASH = SPEC.spec_hash()
HIDDEN = 64
GEN = torch.Generator().manual_seed(52)
ANY = FrameLimits(max_payload_bytes=1 << 30)


@pytest.fixture(scope="module")
def stage():
    """Stage 1 of 2 (the last), as a node wires it; torch work inline."""
    return StageParts(SPEC, StageWorker(SPEC, 1, 16))


def answered(guard: PeerGuard, answer: bytes, before: int) -> dict:
    """The handler's answer: a frame whose ``ok`` is a boolean; a protocol refusal is
    counted against the sender once."""
    assert isinstance(answer, bytes)
    header, _ = decode_frame(answer, ANY)
    assert isinstance(header.get("ok"), bool), header
    if not header["ok"] and str(header.get("error", "")).startswith("protocol"):
        assert guard.refusals.get("malformed") == before + 1
    else:
        assert guard.refusals.get("malformed") == before
    return header


# -- the tensor protocols ----------------------------------------------------------------------
FORWARD = ({"kind": "fwd", "spec": HASH, "deadline_s": 5.0},
           [*encode_activations(torch.randn(2, 16, HIDDEN, generator=GEN), SPEC.activation_codec),
            torch.randint(0, 16, (2, 16), dtype=torch.int32, generator=GEN)])


@fuzz_settings(60)
@given(raw=frames(*FORWARD))
def test_the_forward_handler_answers_anything_and_counts_malformed_requests(stage, raw):
    before = stage.guard.refusals.get("malformed")
    header = answered(stage.guard, asyncio.run(stage.pipeline().handle_forward("QmFuzz", raw)), before)
    if header["ok"]:
        assert isinstance(header["loss"], float)


@pytest.fixture(scope="module")
def outer_base(stage):
    wire = stage.worker.open_round().wire  # the run's default codec: blockwise codes and scales
    stage.worker.open = None
    return {"kind": "outer", "spec": HASH, "round": 0, "ok": True}, wire


@fuzz_settings(40)
@given(data=st.data())
def test_the_outer_handler_answers_a_partners_anything_and_counts_malformed_payloads(stage, outer_base, data):
    raw = data.draw(frames(*outer_base))
    if data.draw(st.booleans()):  # a pair's part: the Delta path checks it too
        raw = data.draw(frames({**outer_base[0], "part": "delta"}, outer_base[1][len(outer_base[1]) // 2:]))
    before = stage.guard.refusals.get("malformed")
    answered(stage.guard, asyncio.run(exchange_as_partner(stage.exchange(), "QmFuzz", raw)), before)


@fuzz_settings(80)
@given(raw=frames({"kind": "outer-fetch", "spec": HASH, "round": 0, "part": "phi"}))
def test_the_outer_fetch_handler_answers_anything(stage, raw):
    before = stage.guard.refusals.get("malformed")
    answered(stage.guard, asyncio.run(stage.exchange().payloads.handle_fetch("QmFuzz", raw)), before)


@fuzz_settings(80)
@given(raw=frames({"kind": "propose", "spec": HASH, "round": 0}))
def test_the_pairing_handler_answers_anything(stage, raw):
    before = stage.guard.refusals.get("malformed")
    answered(stage.guard, asyncio.run(stage.exchange().handle_propose("QmFuzz", raw)), before)


@fuzz_settings(60)
@given(raw=frames({"kind": "state", "spec": HASH, "snapshot": None, "chunk": 0}))
def test_the_state_handler_answers_anything(stage, raw):
    before = stage.guard.refusals.get("malformed")
    header = answered(stage.guard, asyncio.run(stage.state_sync().handle("QmFuzz", raw)), before)
    assert not header["ok"] or header["chunk"] < header["num_chunks"]


@fuzz_settings(60)
@given(raw=frames({"kind": "sketch", "spec": HASH, "seed": 12345, "buckets": SKETCH_BUCKETS}))
def test_the_sketch_handler_answers_anything(stage, raw):
    before = stage.guard.refusals.get("malformed")
    answered(stage.guard, asyncio.run(stage.witnesses().handle("QmFuzz", raw)), before)


# -- the small protocols ------------------------------------------------------------------------
class StatusFields:
    def status_fields(self) -> dict:
        return {"run_id": "fuzz", "stage": 1}


@fuzz_settings(150)
@given(raw=frames({"kind": "status"}))
def test_the_status_handler_answers_anything(raw):
    guard = PeerGuard()
    answer = asyncio.run(handle_status_request(StatusFields(), guard.fault, "QmFuzz", raw))
    answered(guard, answer, 0)


@fuzz_settings(150)
@given(raw=frames({"kind": "dialback", "ports": [31337]}))
def test_the_dial_back_handler_answers_anything_and_dials_only_the_caller(raw):
    guard, dialled = PeerGuard(), []

    async def dial(peer, targets, timeout_s):
        dialled.extend(targets)
        return {t: None for t in targets}

    handle = dialback_handler(guard.fault, dial=dial)
    answer = asyncio.run(handle("QmFuzz", raw, Multiaddr("/ip4/10.0.0.7/tcp/4001")))
    answered(guard, answer, 0)
    assert all(t.startswith("/ip4/10.0.0.7/tcp/") for t in dialled)


def _small_dataset(folder) -> str:
    shard = shard_bytes(torch.arange(3000).numpy() % 256, 256)
    manifest = Manifest(256, "u16", 1024, None, (file_entry("train-0.tok", shard, 1024, tokens=3000),), ())
    (folder / MANIFEST_FILE).write_bytes(manifest.to_bytes())
    (folder / "train-0.tok").write_bytes(shard)
    return manifest.sha256()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    digest = _small_dataset(folder)
    cache = ShardCache(folder, digest, trust_whole_files=True)
    cache.load_manifest()
    return cache, digest


def data_requests(digest: str) -> st.SearchStrategy[bytes]:
    return st.one_of(*(frames(decode_frame(data_request(digest, *what))[0])
                       for what in (("manifest",), ("have",), ("chunk", "train-0.tok", 1))))


@fuzz_settings(150)
@given(data=st.data())
@example(data=None)
def test_the_data_handler_answers_anything(dataset, data):
    cache, digest = dataset
    if data is None:
        raw = encode_frame({"kind": "data", "manifest": digest, "what": "chunk", "name": ["x"], "chunk": 0})
    else:
        raw = data.draw(data_requests(digest))
    guard = PeerGuard()
    server = DataServer(lambda: cache, on_fault=guard.fault)
    answered(guard, asyncio.run(server.handle("QmFuzz", raw)), 0)


# -- streams and lanes -------------------------------------------------------------------------
@pytest.mark.parametrize("paced", [False, True])
@fuzz_settings(80)
@given(data=st.one_of(st.binary(max_size=64), mutated(framed(b"hello")), st.just(framed(b"x" * 2000))))
def test_a_stream_server_answers_or_closes_whatever_bytes_come(paced, data):
    async def scenario():
        transport = Transport(FakeP2P())

        async def echo(remote, request):
            return request

        await transport.serve("/fuzz", echo, ServeLimits(max_request_bytes=1024, paced_request=paced))
        return transport, await stream_to(transport.p2p, "/fuzz", data)

    transport, written = asyncio.run(scenario())
    counts = transport.refusals.as_dict()
    if len(data) >= 8 and int.from_bytes(data[:8], "big") > 1024:
        assert counts["oversize"] == 1 and written == b""
    else:
        assert counts["oversize"] == 0
    assert sum(counts.values()) == counts["oversize"]


@pytest.fixture(scope="module")
def lane_identity():
    return LaneIdentity()


@fuzz_settings(40)
@given(hello=st.none() | st.binary(max_size=90),
       bend=st.sampled_from(["none", "hello", "proof", "request"]), data=st.data())
def test_a_lane_server_opens_or_closes_a_lane_whatever_bytes_come(lane_identity, hello, bend, data):
    """Bytes from anyone who can reach the lane port, before and after a ticket opens it."""
    tickets = Tickets()
    ticket = tickets.issue("QmCaller", "127.0.0.1")
    faults, served = [], []

    async def answer(peer, address, reader, writer):
        try:
            request = await read_frame(reader, 1024)
        except PeerError:
            return False
        served.append(request)
        await write_frame(writer, request)
        return True

    async def scenario():
        server = LaneServer(lane_identity, tickets, {"/swarm-node/forward/1.0.0": answer}.get,
                            lambda peer, why: faults.append(peer))
        server.port = 4242
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        try:
            connecting = asyncio.create_task(asyncio.open_connection(*listener.getsockname()[:2]))
            raw, _ = await asyncio.get_running_loop().sock_accept(listener)
            reader, writer = await connecting
            serving = asyncio.create_task(server._on_lane(raw, "127.0.0.1"))
            challenge = b"c" * CHALLENGE_BYTES
            first = hello if hello is not None else LANE_HELLO + challenge + ticket_id(ticket)
            if bend == "hello":
                first = data.draw(mutated(first))
            writer.write(first)
            if len(first) < HELLO_BYTES:  # the server waits for the rest: it ends here
                writer.write_eof()
            await writer.drain()
            status = await reader.read(1)
            if status == ACCEPTED:
                reply = await reader.readexactly(PROOF_BYTES + CHALLENGE_BYTES)
                proof = caller_proof(ticket, reply[PROOF_BYTES:])
                name = b"/swarm-node/forward/1.0.0"
                request = bytes([len(name)]) + name + framed(b"payload")
                if bend == "proof":
                    proof = data.draw(mutated(proof))
                if bend == "request":
                    request = data.draw(st.binary(max_size=60) | mutated(request))
                writer.write(proof + request)
            if writer.can_write_eof() and not writer.transport.is_closing():
                writer.write_eof()
            async with asyncio.timeout(10):
                await serving  # ends, never raises
            writer.close()
            return status
        finally:
            listener.close()

    status = asyncio.run(scenario())
    if hello is not None and bend == "none":  # no ticket: refused, or closed unread
        assert status in (b"", b"\x00") and not served and not faults
    if hello is None and bend == "none":
        assert status == ACCEPTED and served == [b"payload"] and not faults
    assert set(faults) <= {"QmCaller"} and (status == ACCEPTED or not served)


# -- answers a peer gives us -----------------------------------------------------------------------
class Scripted:
    """A transport whose every answer is ``answer`` (a callable of the request, or bytes)."""

    def __init__(self, answer):
        self.answer = answer
        self.calls = 0

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **_):
        self.calls += 1
        return self.answer(payload) if callable(self.answer) else self.answer


@fuzz_settings(80)
@given(raw=frames({"ok": True, "loss": 2.5}, encode_activations(torch.randn(2, 16, HIDDEN, generator=GEN),
                                                                 SPEC.activation_codec)))
def test_a_next_stages_answer_is_a_gradient_of_our_shape_or_a_peer_error(stage, raw):
    shape = torch.Size([2, 16, HIDDEN])
    try:
        grad, loss = stage.pipeline().next_hop._check_gradient(raw, shape)
    except PeerError:
        return
    assert grad.shape == shape and bool(torch.isfinite(grad).all()) and isinstance(loss, float)


@fuzz_settings(100)
@given(raw=frames(decode_frame(refusal("busy", ["QmSeeker"], 2.0))[0]))
@example(raw=encode_frame({"kind": "propose", "ok": True}))
def test_an_answer_to_our_proposal_is_yes_or_a_typed_refusal(raw):
    parts = StageParts(SPEC, StageWorker(SPEC, 0, 16), transport=Scripted(raw))
    exchange = parts.exchange()

    async def propose():
        await exchange._propose_until_answered("QmPeer", b"proposal", asyncio.get_running_loop().time() + 5)

    try:
        asyncio.run(propose())
    except (Refused, PeerError):
        return


@fuzz_settings(40)
@given(data=st.data())
def test_a_partners_fetched_payload_is_checked_or_refused(stage, outer_base, data):
    raw = data.draw(frames(*outer_base))
    parts = StageParts(SPEC, stage.worker, transport=Scripted(raw))
    payloads = parts.exchange().payloads

    async def fetch():
        return await payloads._fetch("QmPartner", asyncio.get_running_loop().time() + 5)

    try:
        asyncio.run(fetch())
    except (Refused, PeerError):
        pass


@pytest.fixture(scope="module")
def sketch_answer(stage):
    request = encode_frame({"kind": "sketch", "spec": HASH, "seed": 7, "buckets": SKETCH_BUCKETS})
    return decode_frame(asyncio.run(stage.witnesses().handle("QmA", request)), ANY)


@fuzz_settings(60)
@given(data=st.data())
def test_a_witnesses_answer_is_a_sketch_or_nothing(stage, sketch_answer, data):
    raw = data.draw(frames(*sketch_answer))
    parts = StageParts(SPEC, stage.worker, transport=Scripted(raw))
    witness = asyncio.run(parts.witnesses().gather(["QmWitness"], 7)).get("QmWitness")
    if witness is None:
        return
    assert witness.sketch.phi.shape == (len(stage.worker.params), SKETCH_BUCKETS)


@pytest.fixture(scope="module")
def donor():
    worker = StageWorker(SPEC, 1, 16)
    worker.inner.step_count = 5  # ahead of a joiner
    parts = StageParts(SPEC, worker)
    request = encode_frame({"kind": "state", "spec": HASH, "snapshot": None, "chunk": 0})
    return decode_frame(asyncio.run(parts.state_sync().handle("QmJoiner", request)), ANY)


@fuzz_settings(40)
@given(data=st.data())
@example(data=None)  # its tensors in bf16: hashing them crashed the joiner (TypeError), once
def test_a_donors_state_is_checked_or_refused(donor, data):
    if data is None:
        header, tensors = donor
        raw = encode_frame({k: v for k, v in header.items() if k != "v"},
                           [t.to(torch.bfloat16) for t in tensors])
    else:
        raw = data.draw(frames(*donor))
    joiner = StageParts(SPEC, StageWorker(SPEC, 1, 16), transport=Scripted(raw))
    try:
        state = asyncio.run(joiner.state_sync()._fetch("QmDonor"))
    except PeerError:
        return
    assert state.inner_step > 0 and len(state.tensors) == joiner.worker.state_tensor_count()


@fuzz_settings(100)
@given(raw=frames({"kind": "dialback", "ok": True, "observed": "/ip4/10.0.0.1", "results": {"31337": None}}))
def test_a_dial_back_answer_is_a_verdict_or_no_check(raw):
    transport = Scripted(raw)
    transport.peer_id = "QmSelf"
    reach = asyncio.run(check_reachability(transport, ["QmServer"], [31337]))
    assert reach.reachable in (True, False, None)
    assert reach.observed is None or isinstance(reach.observed, str)


@fuzz_settings(150)
@given(raw=st.one_of(st.binary(max_size=120), mutated(Offer("", 4001, b"c" * 32, b"t" * 32, 0).to_wire()),
                     st.builds(msgpack.packb, bent_map({"port": 4001, "cert": b"c" * 32, "ticket": b"t" * 32,
                                                        "ttl": 600.0}))))
def test_a_lane_offer_is_used_or_the_peer_goes_over_libp2p(raw):
    async def ask(peer, timeout_s):
        return raw, "127.0.0.1"

    async def offer():
        return await LanePool(ask)._offer("QmPeer", 1.0)

    try:
        got, fresh = asyncio.run(offer())
    except ProtocolError:
        return
    assert fresh and 0 < got.port < 65536 and got.host == "127.0.0.1"


@fuzz_settings(100)
@given(data=st.data())
@example(data=None)
def test_a_data_answer_is_bytes_we_check_or_a_refusal(dataset, tmp_path_factory, data):
    cache, digest = dataset
    honest = DataServer(lambda: cache, on_fault=lambda peer, why: None)
    request = data_request(digest, "manifest")
    if data is None:
        raw = encode_frame({"ok": True}, [torch.zeros(4, dtype=torch.bfloat16)])
    else:
        valid = decode_frame(asyncio.run(honest.handle("QmMe", request)), ANY)
        raw = data.draw(frames(*valid))

    async def answer(peer, protocol, payload, **_):
        return raw if peer == "QmLiar" else await honest.handle("QmMe", payload)

    transport = types.SimpleNamespace(request=answer)
    fetcher = DataFetcher(ShardCache(tmp_path_factory.mktemp("cache"), digest), transport,
                          peers=lambda: ["QmLiar"], initial=["QmBoot"], progress=False)
    manifest = asyncio.run(fetcher.fetch_manifest(timeout_s=5.0))
    assert manifest == cache.manifest


# -- records the DHT carries -------------------------------------------------------------------------
@fuzz_settings(100)
@given(raw=bent_map(PeerRecord(stage=1, spec_hash=HASH, version="0.1.0").compact_wire()))
def test_a_registry_record_is_used_or_counted_as_a_bad_record(raw):
    guard = PeerGuard()
    view = Membership(spec=SPEC, dht=FakeDHT("QmSelf", {stage_key(SPEC.run_id, 1): {"QmWriter": raw}}),
                      guard=guard, config=NodeConfig(), record=lambda: None)
    try:
        bad = PeerRecord.from_wire(raw).spec_hash != HASH
    except ProtocolError:
        bad = True
    asyncio.run(view.refresh(all_stages=True))
    assert guard.refusals.get("bad-record") == bad
    assert not bad or "QmWriter" not in view.peers[1]


# -- the HTTP status pages (anyone who reaches the port) --------------------------------------------
@fuzz_settings(150)
@given(data=st.one_of(st.binary(max_size=200), mutated(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
                      st.just(b"GET /api/status HTTP/1.1\r\n\r\n"), st.just(b"A" * (MAX_REQUEST_BYTES + 10))))
def test_the_status_pages_answer_http_or_close_whatever_bytes_come(data):
    async def scenario():
        server = StatusServer({"/api/status": lambda: Response(200, b"{}", "application/json")})
        reader, sink = asyncio.StreamReader(limit=MAX_REQUEST_BYTES), Sink()
        reader.feed_data(data)
        reader.feed_eof()
        await server._serve(reader, sink)
        return bytes(sink.data), sink.closed

    written, closed = asyncio.run(scenario())
    assert closed and (written == b"" or written.startswith(b"HTTP/1.1 "))
    if data == b"GET /api/status HTTP/1.1\r\n\r\n":
        assert written.startswith(b"HTTP/1.1 200 OK\r\n") and written.endswith(b"\r\n\r\n{}")

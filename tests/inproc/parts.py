"""A node's components, built the way the node wires them but with fakes around them:
no DHT, no daemon, torch work inline on the event loop. Tests drive one component
through its public seams (handlers, loops, the membership view) and check what the
others saw."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import torch

from swarm_node.gossip.exchange import ExchangeTimes, OuterExchange
from swarm_node.gossip.pairing import PairingCoordinator
from swarm_node.membership.view import Membership
from swarm_node.net.dht import Signed
from swarm_node.net.guard import PeerGuard
from swarm_node.node_config import NodeConfig
from swarm_node.node_services import NodeServices
from swarm_node.obs.stats import NodeStats
from swarm_node.spec import RunSpec
from swarm_node.state.sync import StateSync
from swarm_node.state.witnesses import Witnesses
from swarm_node.train.pipeline import Pipeline
from swarm_node.train.rounds import RoundGate
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame, encode_frame
from swarm_node.wire.records import PeerRecord


class FakeDHT:
    """What Membership needs of a DHT: our id, and records to read (``stored``: key -> peer -> value)."""

    def __init__(self, peer_id: str = "QmSelf", stored: dict | None = None):
        self.peer_id = peer_id
        self.stored = stored or {}
        self.published: list[tuple[str, dict]] = []
        self.sufficient_expiries: list[float | None] = []  # what each read asked for (None: the latest)

    def is_alive(self) -> bool:
        return True

    def wall_now(self) -> float:
        return time.time()

    async def get_signed(self, key: str, sufficient_expiry_s: float | None = None) -> dict[str, Signed]:
        self.sufficient_expiries.append(sufficient_expiry_s)
        return signed_entries(self.stored.get(key, {}))

    async def store_signed(self, key: str, value: dict, ttl_s: float) -> bool:
        self.published.append((key, value))
        return True


def signed_entries(values: dict, ttl_s: float = 15.0) -> dict[str, Signed]:
    """Entries as the DHT returns them: values stored just now, unless given as Signed."""
    return {peer: v if isinstance(v, Signed) else Signed(v, time.time() + ttl_s)
            for peer, v in values.items()}


async def inline(fn, *args, **kwargs):
    """Torch work on the event loop: a stand-in for the node's compute thread."""
    return fn(*args, **kwargs)


def payload_of(worker: StageWorker, dtype: torch.dtype = torch.float32) -> tuple[list, list]:
    """A worker's (phi, Delta) now, as a float payload of its run's fp16 codec carries them."""
    return [t.to(dtype) for t in worker.slow.phi], [t.to(dtype) for t in worker.slow.deltas()]


def partner_payload(spec: RunSpec, phi: list, delta: list, round_no: int = 0) -> dict[str | None, bytes]:
    """A partner's payload as it answers our fetches: whole (None), or the part a
    fetch names (a pair's node fetches Delta, then phi)."""
    header = {"kind": "outer", "spec": spec.spec_hash(), "round": round_no, "ok": True}
    return {None: encode_frame(header, [*phi, *delta]),
            "delta": encode_frame({**header, "part": "delta"}, delta),
            "phi": encode_frame({**header, "part": "phi"}, phi)}


def fetched_part(request: bytes) -> str | None:
    """The part of our payload a fetch asks for (None: the whole)."""
    header, _ = decode_frame(request)
    return header.get("part")


def body_out(pacing: dict, seconds: float = 0.0) -> None:
    """What a real transport does once a request's last byte is written (NextHop's next
    body waits for it: train/uplink.py); a fake transport calls it with its ``**pacing``."""
    if (on_sent := pacing.get("on_sent")) is not None:
        on_sent(seconds)


def record(stage: int, spec: RunSpec, **fields) -> PeerRecord:
    return PeerRecord(stage=stage, spec_hash=spec.spec_hash(), version="0", **{"state": "training", **fields})


@dataclass
class StageParts:
    spec: RunSpec
    worker: StageWorker
    config: NodeConfig = field(default_factory=NodeConfig)
    transport: object = None
    compute: object = inline
    guard: PeerGuard = None
    stats: NodeStats = field(default_factory=NodeStats)
    gate: RoundGate = field(default_factory=RoundGate)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    membership: Membership = None
    announced: list[bool] = field(default_factory=list)  # `seeking` of every record the exchange published

    def __post_init__(self):
        self.guard = self.guard or PeerGuard(admits=self.spec.admits, max_faults=self.config.max_peer_faults,
                                             caller_ban_s=self.config.caller_ban_s)
        if self.membership is None:
            self.membership = Membership(spec=self.spec, dht=FakeDHT(), guard=self.guard, config=self.config,
                                         record=lambda: None)
        self.membership.stage = self.worker.stage.stage_index

    def common(self) -> dict:
        return dict(services=NodeServices(self.compute, self.transport, self.guard, self.stats))

    def pipeline(self) -> Pipeline:
        return Pipeline(spec=self.spec, config=self.config, worker=self.worker, gate=self.gate,
                        next_peers=self.membership.next_stage_peers, stopping=self.stopping, **self.common())

    def exchange(self, own_id: str = "QmSelf", overlapped: bool = True,
                 both_at_once: bool = True) -> OuterExchange:
        """A fresh one per event loop: its events belong to the loop that first waits on them."""
        exchange = None

        async def announce():
            self.announced.append(exchange.seeking)

        exchange = OuterExchange(
            spec_hash=self.spec.spec_hash(), method=self.spec.method.name,
            times=ExchangeTimes(self.config.round_timeout_s, self.config.exchange_timeout_s,
                                overlapped=overlapped,
                                both_at_once=both_at_once),
            state=self.worker,
            gate=self.gate, candidates=self.membership.partner_candidates,
            callers_expected=self.membership.callers_expected, announce=announce,
            stopping=self.stopping, own_id=own_id, max_update_ratio=self.config.max_update_ratio,
            **self.common())
        return exchange

    def witnesses(self, partner_spread=lambda: None) -> Witnesses:
        return Witnesses(worker=self.worker, spec_hash=self.spec.spec_hash(), partner_spread=partner_spread,
                         **self.common())

    def state_sync(self, **options) -> StateSync:
        return StateSync(worker=self.worker, spec_hash=self.spec.spec_hash(),
                         donors=partial(self.membership.callable_peers, self.membership.stage),
                         witnesses=self.witnesses(), progress=False, **options, **self.common())


OUR_ANSWER = encode_frame({"kind": "outer", "ok": True})  # stands in for our (phi, Delta)


async def exchange_as_partner(exchange: OuterExchange, remote: str, frame: bytes) -> bytes:
    """Drive the outer-exchange handler the way a partner does: a round is open and we
    accepted the sender's proposal, so its payload gets past the reservation check to
    the decoding and the checks."""
    pairing = exchange.pairing
    assert isinstance(pairing, PairingCoordinator)
    round_task = asyncio.create_task(pairing.run_round(0, OUR_ANSWER, candidates=list, propose=None,
                                                       send=None, expect_request=True))
    try:
        await pairing.seeking.wait()
        pairing.on_propose(remote)
        return await exchange.payloads.handle_outer(remote, frame)
    finally:
        round_task.cancel()  # a refused payload leaves the round seeking: end it here
        await asyncio.gather(round_task, return_exceptions=True)


class FakeP2P:
    """What Transport.serve needs of a p2p daemon: it keeps the stream handlers, which a
    test calls with a stream of its own (``stream_to``)."""
    peer_id = "QmServer"

    def __init__(self):
        self.handlers = {}

    async def add_binary_stream_handler(self, protocol, handler):
        self.handlers[protocol] = handler

    async def remove_binary_stream_handler(self, protocol):
        self.handlers.pop(protocol, None)


class Sink:
    """A stream's writing end: keeps what was written."""

    def __init__(self):
        self.data = bytearray()
        self.closed = False

    def write(self, data):
        self.data += data

    async def drain(self):
        pass

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed


async def stream_to(p2p: FakeP2P, protocol: str, data: bytes, *, caller: str = "QmCaller",
                    addr: str = "/ip4/10.0.0.7/tcp/4001", end: bool = True) -> bytes:
    """``data`` arrives from ``caller`` on a stream to ``protocol`` (and the stream ends,
    unless not ``end``); what the server wrote back before it closed the stream."""
    reader, sink = asyncio.StreamReader(), Sink()
    reader.feed_data(data)
    if end:
        reader.feed_eof()
    await p2p.handlers[protocol](SimpleNamespace(peer_id=caller, addr=addr), reader, sink)
    assert sink.closed
    return bytes(sink.data)


def framed(body: bytes) -> bytes:
    """One stream frame (net/transport.py): u64 length, then the bytes."""
    return len(body).to_bytes(8, "big") + body

"""One peer of the sync-cost benchmark, run as its own process (``python -m
bench.sync_cost.peer``) with its own hivemind DHT and libp2p daemon, steered by the
parent (bench/sync_cost/benchmark.py) through JSON lines:

    parent -> peer (stdin):  {"cmd": <name>, ...arguments}
    peer -> parent (stdout): "SBA " + {"ok": true, ...results} or {"ok": false, "error": "..."}

Its first line is ``{"event": "up", "peer_id": ..., "maddrs": [...]}``. Everything else on
stdout or stderr (hivemind's logs) is not part of the protocol.

A pair round is the node's own outer round: the node's ``OuterExchange``
(swarm_node/gossip/exchange.py) with its ``PairingCoordinator``, its pairing and
exchange protocols and limits, its ``PartnerCheck`` on what arrives, and its compute
calls (phi and Delta cast to the wire precision, framed, decoded, checked, averaged),
run over a stage of one flat tensor (``FlatStage``) instead of a model. The only
stand-in is the ``seeking`` flag: the node reads it from registry records refreshed
every few seconds, here peers share it at once through a small file (the
``SeekingBoard``), the best case for the node.

A matched pair round is the same with the partner and the side that sends drawn ahead
by the parent: no two requests cross, so it shows what the pair pattern costs without
the pairing protocol's refusals."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.sync_cost.ipc import REPLY_MARK, SeekingBoard
from swarm_node.gossip.exchange import ExchangeTimes, OuterExchange
from swarm_node.gossip.partner_check import PartnerCheck
from swarm_node.net import protocols
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.guard import PeerGuard
from swarm_node.net.transport import ServeLimits, Transport
from swarm_node.node_services import NodeServices
from swarm_node.obs.stats import NodeStats
from swarm_node.train.rounds import RoundGate
from swarm_node.train.worker import OpenRound
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.outer_codec import OUTER_CODECS, decode_outer

MESSAGE_PROTOCOL = "swarm-node-bench/message/1"
SPEC_HASH = "sync-cost-bench"


def reply(**fields) -> None:
    print(REPLY_MARK + json.dumps(fields), flush=True)


async def sleep_until(wall_time: float) -> None:
    """The parent schedules rounds by wall-clock time: every peer runs on this machine's clock."""
    await asyncio.sleep(max(0.0, wall_time - time.time()))


class FlatStage:
    """A stage of one flat tensor, with what the node's exchange needs of its worker.
    Every peer's phi is the same init plus its own drift of about one Delta, as between
    partners of a real stage (the partner check compares their distance with Delta)."""

    def __init__(self, params: int, seed: int, rank: int):
        common = torch.Generator().manual_seed(seed)
        own = torch.Generator().manual_seed(seed * 1000 + rank)
        self.phi = torch.randn(params, generator=common) * 0.02 + torch.randn(params, generator=own) * 1e-3
        self.delta = torch.randn(params, generator=own) * 1e-3
        self.params = [self.phi]
        self.outer_round = 0

    codec = OUTER_CODECS["fp16"]

    def wire_payload(self) -> list[torch.Tensor]:
        return [self.phi.half(), self.delta.half()]

    def open_round(self, overlapped: bool) -> OpenRound:
        self.open = OpenRound(self.outer_round, self.wire_payload(), 1.0, None)
        return self.open

    def own_payload(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.decode_payload(self.open.wire, self.phi.device)

    def decode_payload(self, wire, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return decode_outer(wire, [self.phi.shape], self.codec, device)

    def close_round(self, others) -> None:
        """The outer step's group means over the members, from the wire values as the node
        computes them; the result is discarded, only its cost counts."""
        for members in zip(*(phi + delta for phi, delta in (self.own_payload(), *others))):
            torch.stack([m.float() for m in members]).mean(0)

    def own_phi(self) -> list[torch.Tensor]:
        return [self.phi]

    def own_delta(self) -> list[torch.Tensor]:
        return [self.delta]

    def outer_round_due(self) -> bool:  # rounds start when the parent says
        return False

    def round_fraction(self) -> float:
        return 1.0

    def can_round_early(self) -> bool:
        return False

    def force_round(self) -> None:
        pass


class BenchPeer:
    def __init__(self, rank: int, dht: SwarmDHT, transport: Transport, board: SeekingBoard):
        self.rank = rank
        self.dht = dht
        self.transport = transport
        self.board = board
        self.peer_ids: list[str] = []  # by rank, set by the parent
        # Torch work runs here, never on the event loop (as in the node): the loop keeps
        # serving streams while frames are encoded and decoded.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.stage = FlatStage(0, 0, rank)
        self.limits = FrameLimits()
        self.check = PartnerCheck(max_update_ratio=10.0)  # for single messages, as the node checks a payload
        self.exchange: OuterExchange | None = None
        self.round_key = 0
        self.candidates = list  # set for each round by _plan
        self.callers_expected = False
        self.averager = None
        self.control = None
        self.compute_s = 0.0

    async def compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._timed, fn, args)

    def _timed(self, fn, args):
        """Adds the call's time to ``compute_s``: how much of a round is torch work (cast,
        encode, decode, checks, means) rather than waiting for the network or the partner."""
        started = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.compute_s += time.monotonic() - started

    async def serve(self) -> None:
        limits = ServeLimits(max_request_bytes=1 << 31, max_concurrent=4, max_per_peer=1,
                             handler_timeout_s=600.0)
        await self.transport.serve(MESSAGE_PROTOCOL, self._handle_message, limits)

    # -- the payload ------------------------------------------------------------------
    async def cmd_load(self, params: int, seed: int) -> dict:
        """A stage of ``params`` parameters (fp32; values like a model's), and the node's
        exchange over it, serving the node's pairing and exchange protocols."""
        self.stage = await self.compute(FlatStage, params, seed, self.rank)
        self.limits = FrameLimits(max_payload_bytes=2 * params * 4 + (1 << 20))
        for name in (protocols.PAIR, protocols.OUTER, protocols.OUTER_FETCH):
            await self.transport.stop_serving(name)
        self.exchange = OuterExchange(
            spec_hash=SPEC_HASH, method="noloco", times=ExchangeTimes(round_timeout_s=60.0, exchange_s=600.0),
            state=self.stage, gate=RoundGate(), services=NodeServices(self.compute, self.transport,
                                                                      PeerGuard(),
                                                                        NodeStats()),
            candidates=lambda: self.candidates(), callers_expected=lambda: self.callers_expected,
            announce=self._announce, stopping=asyncio.Event(), own_id=self.transport.peer_id)
        await self.exchange.serve(self.transport, authorize=lambda peer: True)
        return {}

    def own_frame(self) -> tuple[list[torch.Tensor], bytes]:
        wire = self.stage.wire_payload()
        return wire, encode_frame({"kind": "outer", "spec": SPEC_HASH, "ok": True}, wire)

    # -- one message ------------------------------------------------------------------
    async def _handle_message(self, remote: str, request: bytes) -> bytes:
        _, tensors = await self.compute(decode_frame, request, self.limits)
        await self.compute(self.check.check, tensors, self.stage.own_phi(), self.stage.own_delta)
        return encode_frame({"ok": True})

    async def cmd_message(self, to: int, repeats: int, request_timeout_s: float) -> dict:
        """Seconds for one payload to reach peer ``to`` and be acknowledged: encode,
        one stream, the receiver's decode and checks, a small answer."""
        times = []
        for _ in range(repeats + 1):  # the first, on a fresh stream and cold buffers, is not counted
            started = time.monotonic()
            _, frame = await self.compute(self.own_frame)
            await self.transport.request(self.peer_ids[to], MESSAGE_PROTOCOL, frame,
                                         timeout_s=request_timeout_s, max_response_bytes=1 << 16)
            times.append(time.monotonic() - started)
        return {"times_s": times[1:], "frame_bytes": len(frame)}

    # -- a NoLoCo pair round ----------------------------------------------------------
    async def _announce(self) -> None:
        """The node publishes its record (saying whether it seeks); here, the board."""
        self.board.set(self.rank, self.round_key if self.exchange.seeking else 0)

    def _plan(self, round_key: int, others: list[int], partner: int | None, initiate: bool) -> None:
        """What the round may choose from. The node's way (``partner`` None): every other
        peer of the stage, those seeking first. Matched: only the initiator asks, and only
        once its partner is seeking; the other side just waits for the request."""
        if partner is None:
            self.candidates = lambda: [(self.peer_ids[r], self.board.get(r) == round_key) for r in others]
        elif not initiate:
            self.candidates = list
        else:
            self.candidates = lambda: ([(self.peer_ids[partner],
                                         True)] if self.board.get(partner) == round_key
                                       else [])
        self.callers_expected = partner is not None

    async def cmd_pair_round(self, round_key: int, members: list[int], start_at: float, delay_s: float,
                             request_timeout_s: float, round_timeout_s: float, partner: int | None = None,
                             initiate: bool = False) -> dict:
        others = [r for r in members if r != self.rank]
        rank_of = {self.peer_ids[r]: r for r in others}
        self._plan(round_key, others, partner, initiate)
        self.exchange.pairing.request_timeout_s = request_timeout_s
        self.exchange.pairing.round_timeout_s = round_timeout_s
        self.stage.outer_round = self.round_key = round_key
        await sleep_until(start_at + delay_s)
        ready = time.time()
        self.compute_s = 0.0
        try:
            outcome = await self.exchange.run_round()
        finally:
            self.board.set(self.rank, 0)
        end = time.time()
        partner_id = outcome.partners[0] if outcome.partners else None
        initiated = outcome.exchange_s is not None
        return {"ready": ready, "end": end, "partner": rank_of[partner_id] if partner_id else None,
                "initiated": bool(partner_id and initiated), "attempts": outcome.proposals,
                "exchange_s": outcome.exchange_s if partner_id else None, "compute_s": self.compute_s}

    # -- hivemind's all-reduce --------------------------------------------------------
    async def cmd_averager_open(self, prefix: str, group_size: int, compression: str,
                                matchmaking_s: float) -> dict:
        from hivemind import DecentralizedAverager
        from hivemind.compression import Float16Compression, NoCompression

        codec = Float16Compression() if compression == "fp16" else NoCompression()
        # min = target = the stage size: the group is always the whole stage, and it
        # assembles as soon as everyone has joined. Created on the main thread (hivemind
        # installs signal handlers) while no round is running, so blocking the loop is harmless.
        self.averager = DecentralizedAverager(
            [self.stage.phi.clone(), self.stage.delta.clone()], self.dht.dht, start=True, prefix=prefix,
            target_group_size=group_size, min_group_size=group_size, min_matchmaking_time=matchmaking_s,
            request_timeout=matchmaking_s / 3, compression=codec, allow_state_sharing=False)
        return {}

    async def cmd_allreduce_prepare(self, timeout_s: float) -> dict:
        """Start matchmaking ahead of the round and wait until a group is found (what
        hivemind.Optimizer does with pre-scheduled averaging)."""
        from hivemind.averaging.control import AveragingStage

        started = time.monotonic()
        self.control = await asyncio.to_thread(self.averager.step, require_trigger=True, wait=False,
                                               timeout=timeout_s, allow_retries=False)
        while self.control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
            if self.control.done() or time.monotonic() - started > timeout_s:
                break
            await asyncio.sleep(0.005)
        return {"matchmaking_s": time.monotonic() - started, "matched": self.control.stage.name}

    async def cmd_allreduce_go(self, start_at: float, delay_s: float, timeout_s: float) -> dict:
        await sleep_until(start_at + delay_s)
        ready = time.time()
        self.control.allow_allreduce()
        gathered = await asyncio.to_thread(self.control.result, timeout_s)
        end = time.time()
        self.control = None
        return {"ready": ready, "end": end, "group_size": len(gathered) if gathered else 0}

    async def cmd_averager_close(self) -> dict:
        if self.averager is not None:
            await asyncio.to_thread(self.averager.shutdown)
            self.averager = None
        return {}

    # -- plumbing ---------------------------------------------------------------------
    async def cmd_peers(self, peer_ids: list[str]) -> dict:
        self.peer_ids = peer_ids
        return {}

    async def dispatch(self, command: dict) -> None:
        name = command.pop("cmd")
        try:
            result = await getattr(self, f"cmd_{name}")(**command)
            reply(ok=True, **result)
        except Exception as exc:  # the parent records the failure; hivemind raises bare Exceptions
            reply(ok=False, error=f"{type(exc).__name__}: {exc}")

    async def close(self) -> None:
        await self.cmd_averager_close()
        self._pool.shutdown(wait=False)


async def read_commands():
    """Yield the parent's commands from stdin until it closes the pipe or says exit."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        if command.get("cmd") == "exit":
            return
        yield command


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # up to 8 peers share 2 cores
    dht = await SwarmDHT.start(initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/0"])
    peer = None
    try:
        transport = Transport(await dht.replicate_p2p())
        peer = BenchPeer(args.rank, dht, transport, SeekingBoard(args.board, args.num_slots))
        await peer.serve()
        reply(event="up", peer_id=dht.peer_id, maddrs=dht.visible_maddrs())
        async for command in read_commands():
            await peer.dispatch(command)
    finally:
        if peer is not None:
            await peer.close()
        await dht.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one peer of bench.sync_cost (started by it)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--board", type=Path, required=True, help="the seeking board file")
    parser.add_argument("--num-slots", type=int, required=True)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
    sys.stdout.flush()
    os._exit(0)  # hivemind's leftover threads must not hold the exit up

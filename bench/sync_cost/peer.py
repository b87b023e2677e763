"""One peer of the sync-cost benchmark, run as its own process (``python -m
bench.sync_cost.peer``) with its own hivemind DHT and libp2p daemon, steered by the
parent (bench/sync_cost/benchmark.py) through JSON lines:

    parent -> peer (stdin):  {"cmd": <name>, ...arguments}
    peer -> parent (stdout): "SBA " + {"ok": true, ...results} or {"ok": false, "error": "..."}

Its first line is ``{"event": "up", "peer_id": ..., "maddrs": [...]}``. Everything else on
stdout or stderr (hivemind's logs) is not part of the protocol.

A pair round does what the node's outer round does (swarm_node/node.py ``_outer_round``,
``_send_outer``, ``_handle_outer``) with the node's own pieces: phi and Delta cast to the
wire precision and framed by ``encode_frame``, the partner found by the node's
``PairingCoordinator`` (a few-byte proposal to a random peer among those that announce
``seeking``; busy or not-ready answers mean a random back-off and another try; crossed
proposals pair by peer id), then one ``Transport.request`` carrying our frame and
bringing the partner's back, ``decode_frame`` and the node's
checks on what arrived, then the group mean. The only stand-in is the ``seeking`` flag:
the node reads it from registry records refreshed every few seconds, here peers share it
at once through a small file (the ``SeekingBoard``), the best case for the node.

A matched pair round is the same with the partner and the side that sends drawn ahead
by the parent: no two requests cross, so it shows what the pair pattern costs without
the pairing protocol's refusals."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.sync_cost.ipc import REPLY_MARK, SeekingBoard
from swarm_node.errors import ProtocolError
from swarm_node.gossip.pairing import PairingCoordinator, Refused
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.transport import ServeLimits, Transport
from swarm_node.train.worker import finite
from swarm_node.wire.codec import WIRE_PRECISIONS, FrameLimits, decode_frame, encode_frame

PROPOSE_PROTOCOL = "swarm-node-bench/propose/1"
PAIR_PROTOCOL = "swarm-node-bench/pair/1"
MESSAGE_PROTOCOL = "swarm-node-bench/message/1"


def reply(**fields) -> None:
    print(REPLY_MARK + json.dumps(fields), flush=True)


async def sleep_until(wall_time: float) -> None:
    """The parent schedules rounds by wall-clock time: every peer runs on this machine's clock."""
    await asyncio.sleep(max(0.0, wall_time - time.time()))


def check_partner(tensors: list[torch.Tensor], own_phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The node's checks of a partner's (phi, Delta), the same calls in the same order:
    worker.check_partner_tensors (count, shape, dtype, ``finite``), then the magnitude
    screens' inputs of node._partner_magnitudes (Delta's norm, phi's distance from ours)."""
    if len(tensors) != 2:
        raise ProtocolError(f"expected 2 tensors, got {len(tensors)}")
    for t in tensors:
        if t.shape != own_phi.shape or not t.dtype.is_floating_point or not finite(t):
            raise ProtocolError("partner tensor does not fit this stage")
    phi, delta = tensors
    distance = math.sqrt(float((phi.float() - own_phi).pow(2).sum()))
    if not math.isfinite(distance + own_norm([delta])):
        raise ProtocolError("non-finite magnitude")
    return phi, delta


def own_norm(tensors: list[torch.Tensor]) -> float:
    """node._norm: the Delta norm the node computes for its own and each partner's Delta."""
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in tensors))


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
        self.phi = torch.zeros(0)
        self.delta = torch.zeros(0)
        self.wire_dtype = WIRE_PRECISIONS["fp16"]
        self.limits = FrameLimits()
        self.coordinator = PairingCoordinator(round_timeout_s=60.0, request_timeout_s=30.0,
                                              own_id=transport.peer_id)
        self.averager = None
        self.control = None
        self.attempts = 0
        self.exchange_s: float | None = None
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
        limits = ServeLimits(max_request_bytes=1 << 31, max_concurrent=4, max_per_peer=1, handler_timeout_s=600.0)
        await self.transport.serve(PROPOSE_PROTOCOL, self._handle_propose,
                                   ServeLimits(max_request_bytes=4096, max_concurrent=8, max_per_peer=1,
                                               handler_timeout_s=5.0))
        await self.transport.serve(PAIR_PROTOCOL, self._handle_pair, limits)
        await self.transport.serve(MESSAGE_PROTOCOL, self._handle_message, limits)

    # -- the payload ------------------------------------------------------------------
    def load(self, params: int, seed: int) -> None:
        """phi and Delta of a stage of ``params`` parameters (fp32; values like a model's)."""
        gen = torch.Generator().manual_seed(seed * 1000 + self.rank)
        self.phi = torch.randn(params, generator=gen) * 0.02
        self.delta = torch.randn(params, generator=gen) * 1e-3
        self.limits = FrameLimits(max_payload_bytes=2 * params * 4 + (1 << 20))

    def own_wire(self) -> list[torch.Tensor]:
        """phi and Delta in the wire precision, as the node sends them."""
        return [self.phi.to(self.wire_dtype), self.delta.to(self.wire_dtype)]

    def own_frame(self) -> tuple[list[torch.Tensor], bytes]:
        wire = self.own_wire()
        return wire, encode_frame({"kind": "outer", "ok": True}, wire)

    @staticmethod
    def group_mean(own_wire: list[torch.Tensor], partner: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The outer step's group means over (own, partner), from the wire values as the
        node computes them; the result is discarded, only its cost counts."""
        for own, theirs in zip(own_wire, partner):
            (own.float() + theirs.float()).mul_(0.5)

    # -- one message ------------------------------------------------------------------
    async def _handle_message(self, remote: str, request: bytes) -> bytes:
        _, tensors = await self.compute(decode_frame, request, self.limits)
        await self.compute(check_partner, tensors, self.phi)
        return encode_frame({"ok": True})

    async def cmd_message(self, to: int, repeats: int, request_timeout_s: float) -> dict:
        """Seconds for one payload to reach peer ``to`` and be acknowledged: encode,
        one stream, the receiver's decode and checks, a small answer."""
        times = []
        for _ in range(repeats + 1):  # the first, on a fresh stream and cold buffers, is not counted
            started = time.monotonic()
            _, frame = await self.compute(self.own_frame)
            await self.transport.request(self.peer_ids[to], MESSAGE_PROTOCOL, frame, timeout_s=request_timeout_s,
                                         max_response_bytes=1 << 16)
            times.append(time.monotonic() - started)
        return {"times_s": times[1:], "frame_bytes": len(frame)}

    # -- a NoLoCo pair round ----------------------------------------------------------
    async def _handle_propose(self, remote: str, request: bytes) -> bytes:
        try:
            self.coordinator.on_propose(remote)
            return encode_frame({"ok": True})
        except Refused as exc:
            return encode_frame({"ok": False, "error": str(exc)})

    async def _send_propose(self, peer: str, timeout_s: float) -> None:
        self.attempts += 1
        raw = await self.transport.request(peer, PROPOSE_PROTOCOL, encode_frame({"kind": "propose"}),
                                           timeout_s=timeout_s, max_response_bytes=4096)
        header, _ = decode_frame(raw)
        if not header.get("ok"):
            raise Refused(str(header.get("error", "refused")))

    async def _handle_pair(self, remote: str, request: bytes) -> bytes:
        async def partner_payload():
            _, tensors = await self.compute(decode_frame, request, self.limits)
            return await self.compute(check_partner, tensors, self.phi)

        try:
            return await self.coordinator.answer(remote, partner_payload)
        except Refused as exc:
            return encode_frame({"ok": False, "error": str(exc)})
        except ProtocolError:
            return encode_frame({"ok": False, "error": "protocol"})

    async def _send_pair(self, peer: str, payload: bytes, timeout_s: float):
        started = time.monotonic()
        raw = await self.transport.request(peer, PAIR_PROTOCOL, payload, timeout_s=timeout_s,
                                           max_response_bytes=self.limits.max_payload_bytes + (1 << 16))
        header, tensors = await self.compute(decode_frame, raw, self.limits)
        if not header.get("ok"):
            raise Refused(str(header.get("error", "refused")))
        partner = await self.compute(check_partner, tensors, self.phi)
        self.exchange_s = time.monotonic() - started
        return partner

    def _candidates(self, round_key: int, others: list[int], partner: int | None, initiate: bool):
        """What ``run_round`` may choose from. The node's way (``partner`` None): every
        other peer of the stage, those seeking first. Matched: only the initiator asks,
        and only once its partner is seeking; the other side just waits for the request."""
        if partner is None:
            return lambda: [(self.peer_ids[r], self.board.get(r) == round_key) for r in others]
        if not initiate:
            return lambda: []
        return lambda: [(self.peer_ids[partner], True)] if self.board.get(partner) == round_key else []

    async def cmd_pair_round(self, round_key: int, members: list[int], start_at: float, delay_s: float,
                             request_timeout_s: float, round_timeout_s: float, partner: int | None = None,
                             initiate: bool = False) -> dict:
        others = [r for r in members if r != self.rank]
        rank_of = {self.peer_ids[r]: r for r in others}
        self.coordinator.request_timeout_s = request_timeout_s
        self.coordinator.round_timeout_s = round_timeout_s
        self.attempts, self.exchange_s = 0, None
        await sleep_until(start_at + delay_s)
        ready = time.time()
        self.compute_s = 0.0
        wire, frame = await self.compute(self.own_frame)
        await self.compute(own_norm, wire[1:])  # the node notes its own Delta norm before seeking
        self.board.set(self.rank, round_key)
        try:
            result = await self.coordinator.run_round(
                round_key, frame, candidates=self._candidates(round_key, others, partner, initiate),
                propose=self._send_propose, send=self._send_pair, expect_request=partner is not None)
        finally:
            self.board.set(self.rank, 0)
        if result is not None:
            await self.compute(self.group_mean, wire, result.payload)
        end = time.time()
        return {"ready": ready, "end": end, "partner": rank_of[result.partner] if result else None,
                "initiated": bool(result and result.initiated), "attempts": self.attempts,
                "exchange_s": self.exchange_s if result and result.initiated else None, "compute_s": self.compute_s}

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
            [self.phi.clone(), self.delta.clone()], self.dht.dht, start=True, prefix=prefix,
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

    async def cmd_load(self, params: int, seed: int) -> dict:
        await self.compute(self.load, params, seed)
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

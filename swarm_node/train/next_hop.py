"""The hop to a next-stage peer: one micro-batch's activations out, the gradient back.

What it owns: the forward request (encoded on the wire thread, train/hop_work.py); the
choice of peer (routing/chooser.py), weighted by what our hops to each measured and not
by what their records claim, with at most one unverified peer probed a micro-batch
(net/guard.py) and no more than FORWARD_PER_CALLER hops at once to one peer; retries
with another peer within the micro-batch's deadline, the failed peer banned (a single
stream reset is retried at once, a refusal or an answer out of scale sends the
micro-batch elsewhere without blame); and the gradient answer checked and screened
(train/screen.py). What the stage computes before and after is train/pipeline.py's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from swarm_node.errors import NotEnoughPeers, OutOfScale, PeerError, PeerRefused, StreamClosed
from swarm_node.net import protocols
from swarm_node.net.transport import short_id
from swarm_node.node_config import NodeConfig
from swarm_node.node_services import NodeServices
from swarm_node.routing.chooser import Candidate, PeerChooser, RoundTrips
from swarm_node.spec import RunSpec
from swarm_node.train.hop_work import encode_forward
from swarm_node.train.host_copy import HostCopy, pinned_for
from swarm_node.train.screen import MagnitudeScreen
from swarm_node.train.uplink import Turn, UplinkQueue
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import FrameLimits
from swarm_node.wire.messages import decode_gradient_answer, rms
from swarm_node.wire.records import PeerRecord

log = logging.getLogger(__name__)

# Forward requests a node serves at once for one caller (more are answered busy): a node
# sends no more than this to one next-stage peer at a time, whatever its window.
FORWARD_PER_CALLER = 4
HOP_FREED_POLL_S = 0.02  # how often a hop that found every next-stage peer at that cap looks again


class NextHop:
    def __init__(self, *, spec: RunSpec, config: NodeConfig, worker: StageWorker, services: NodeServices,
                 next_peers: Callable[[], dict[str, PeerRecord]], frame_limits: FrameLimits):
        self.spec_hash, self.codec = spec.spec_hash(), worker.wire_codec
        self.config = config
        self.worker = worker
        self.transport, self.guard, self.stats = services.transport, services.guard, services.stats
        self.wire = services.wire or services.compute
        self.next_peers = next_peers  # live, callable peers of the next stage
        self.frame_limits = frame_limits
        self.chooser = PeerChooser(is_banned=self.guard.is_banned)
        self.round_trips = RoundTrips()  # what our hops to each next-stage peer measured
        self.uplink = UplinkQueue()  # link-bound or not; then our bodies one at a time, and each peer's rate
        # the magnitude screen for the gradients next-stage peers send (train/screen.py): wire thread only
        self._gradient_screen = MagnitudeScreen(config.max_activation_ratio, window=64)

    async def send(self, outgoing: HostCopy, shape: torch.Size, targets: torch.Tensor,
                   timeout_s: float) -> tuple[torch.Tensor, float]:
        """Send activations (of ``shape``, encoded by the run's codec, on their way to the
        host) to a next-stage peer; returns (grad wrt them, loss). Retries other peers on
        failure, banning the failed one."""
        next_stage = self.worker.stage.stage_index + 1
        clock = asyncio.get_running_loop().time  # time.monotonic, or a test's virtual clock
        deadline = clock() + timeout_s
        payload = await self.wire(encode_forward,
                                  {"kind": "fwd", "spec": self.spec_hash, "deadline_s": timeout_s}, outgoing,
                                  targets, self.codec)
        tried: set[str] = set()
        attempts = 0
        while True:
            remaining = deadline - clock()
            if remaining <= 0 or attempts > self.config.hop_retries:
                raise NotEnoughPeers(f"no stage-{next_stage} peer completed the micro-batch after "
                                     f"{attempts} attempts")
            # one unverified peer at most per micro-batch: a flood of forged records cannot use up
            # its attempts
            probe = not any(not self.guard.is_verified(p) for p in tried)
            try:
                async with asyncio.timeout(remaining):  # our turn on the uplink (train/uplink.py)
                    turn = await self.uplink.turn(len(payload))
            except TimeoutError:
                continue  # out of time: the loop's head says so
            peer = self.chooser.choose(self._candidates(probe), exclude=tried, per_peer=FORWARD_PER_CALLER,
                                       body_rates=self.uplink if self.uplink.link_bound else None)
            if peer is None:  # none known, all tried, or all as busy with us as they take
                turn.release()
                busy = any(n >= FORWARD_PER_CALLER for n in self.chooser.in_flight.values())
                # the registry loop may show someone by then; a hop of ours ends soon
                await asyncio.sleep(min(HOP_FREED_POLL_S if busy else 0.5, remaining))
                tried.clear()
                continue
            attempts += 1
            if attempts > 1:
                self.stats.retries += 1
            self.chooser.started(peer)
            sent = clock()

            def body_sent(seconds: float, peer: str = peer, turn: Turn = turn) -> None:
                self.uplink.note(peer, len(payload), seconds)
                turn.release()
            try:
                raw = await self.transport.request(peer, protocols.FORWARD, payload, timeout_s=remaining,
                                                   max_response_bytes=len(payload) + (1 << 16),
                                                   paced_request=True, paced_response=True, on_sent=body_sent)
                grad, loss = await self.wire(self._check_gradient, raw, shape)
                self.guard.succeeded(peer)
                self.round_trips.note(peer, shape[0], clock() - sent)
                self.stats.to_next.note(len(payload), len(raw), targets.numel())
                return grad, loss
            except PeerRefused as exc:
                tried.add(peer)
                log.debug("stage-%d peer %s refused: %s", next_stage, short_id(peer), exc)
            except OutOfScale as exc:  # this micro-batch only: the peer is not at fault
                tried.add(peer)
                self.guard.note(peer, f"stage-{next_stage} peer {short_id(peer)}: {exc}; micro-batch sent "
                                      f"elsewhere")
            except StreamClosed as exc:
                tried.add(peer)
                if self.guard.stream_closed(peer):  # twice in a row: it refuses us, or is unwell
                    self._peer_failed(next_stage, peer, f"{exc}, twice in a row")
                else:  # once: a reset inside the daemons, retried at once
                    log.debug("stage-%d peer %s: %s; retrying", next_stage, short_id(peer), exc)
            except PeerError as exc:
                tried.add(peer)
                self._peer_failed(next_stage, peer, str(exc))
            finally:
                turn.release()
                self.chooser.finished(peer)

    def _candidates(self, probe: bool = True) -> list[Candidate]:
        """Next-stage peers to route to, weighted by what we measured (and how lately:
        routing/chooser.py), not by what their records claim (anyone can sign a record
        claiming any throughput): verified peers, and at most one unverified one to probe
        (net/guard.py)."""
        records = self.next_peers()
        self.round_trips.keep_only(records)
        self.uplink.keep_only(records)
        return [self.round_trips.candidate(p, min(records[p].queue, self.config.max_queue))
                for p in self.guard.probe_set(list(records), self.chooser.rng, probe=probe)]

    def _peer_failed(self, stage: int, peer: str, why: str) -> None:
        ban_s = self.guard.failed(peer)
        self.stats.note_failure(f"stage-{stage} peer {short_id(peer)} failed: {why}")
        self.guard.note(peer, f"stage-{stage} peer {short_id(peer)} failed ({why}); banned for {ban_s:.0f}s")

    def _check_gradient(self, raw: bytes, shape: torch.Size) -> tuple[torch.Tensor, float]:
        """On the wire thread: the next stage's answer, checked and screened."""
        grad, loss = decode_gradient_answer(raw, self.frame_limits, shape, self.codec)
        problem = self._gradient_screen.check(rms(grad), "gradient RMS")
        if problem:
            raise OutOfScale(problem)
        return pinned_for(grad, self.worker.device), loss

"""The data path: where a micro-batch goes and what comes back.

Stage 0 draws micro-batches from its data shard and keeps as many of them in the
pipeline as keep its compute busy (routing/window.py); each is run through this stage
and sent to a next-stage peer (train/next_hop.py: which one, and another on failure),
which does the same until the last stage computes the loss and the gradients travel
back the same way. The hop, forward / send / backward, is one method (``_hop``) for
stage 0's own micro-batches and those a middle stage serves, with the same handling of
a lost micro-batch. Every stage steps its inner optimizer when enough samples are in
(train/worker.py) and hands over to the outer round when one is due (train/rounds.py).

A failed hop is retried with another peer within the micro-batch's deadline; the
failed peer is banned (net/guard.py), except for a single stream reset, which is
retried at once. A micro-batch whose deadline passes is lost and counted. Stage 0's
deadline stretches with its link's measured pace (routing/window.py); a stage serving
the one before takes the deadline its request carries, up to max_hop_deadline_s.

Forwards, backwards and steps run on the compute thread; encoding and decoding what
crosses the boundary runs on the wire thread beside it (train/compute.py; the work
itself is train/hop_work.py's), the bytes move on the event loop and the lanes'
threads (net/), so the next micro-batch computes while this one travels."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from functools import partial

import torch

from swarm_node.data.sharded_batches import ShardedBatches
from swarm_node.data.slot_batches import SlotBatches
from swarm_node.data.source import RunData
from swarm_node.errors import (
    NotEnoughPeers,
    OutOfScale,
    OwnOutputNotFinite,
    PeerError,
    ProtocolError,
)
from swarm_node.net import protocols
from swarm_node.net.transport import ServeLimits, short_id
from swarm_node.node_config import NodeConfig
from swarm_node.node_services import NodeServices
from swarm_node.routing.window import ROUND_WINDOW, InFlightWindow, ServedRate
from swarm_node.spec import RunSpec
from swarm_node.train.compute import FairTurns
from swarm_node.train.hop_work import (
    backward_step,
    encode_answer,
    forward_to_host,
    last_stage_step,
    timed,
)
from swarm_node.train.host_copy import pinned_for
from swarm_node.train.next_hop import FORWARD_PER_CALLER, NextHop
from swarm_node.train.rounds import RoundGate, step_if_ready
from swarm_node.train.screen import MagnitudeScreen
from swarm_node.train.worker import StageWorker, throughput_ema
from swarm_node.wire import boundary as coded
from swarm_node.wire.boundary import window_ids
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.messages import check_forward_request, rms
from swarm_node.wire.records import PeerRecord

log = logging.getLogger(__name__)

NEXT_STAGE_POLL_S = 0.5
FINISH_POLL_S = 1.0
UPSTREAM_CHECK_S = 5.0  # a DHT read: how often a later stage given max_steps asks whether the run is over
QUIET_AT_LIMIT_S = 3.0  # at max_steps, no micro-batch for this long: the stage before needs no more answers
# at most this long answering past max_steps (a stage 0 with no limit never stops sending)
LIMIT_GRACE_S = 30.0
SHARDS_BY_PEER_ID = 1024  # a node without --data-shard reads the shard its peer id hashes to


class MicrobatchLost(Exception):
    """A hop lost its micro-batch (counted where it was lost); the text is what the stage before is told."""


class Pipeline:
    def __init__(self, *, spec: RunSpec, config: NodeConfig, worker: StageWorker, services: NodeServices,
                 gate: RoundGate, next_peers: Callable[[], dict[str, PeerRecord]], stopping: asyncio.Event):
        self.spec = spec
        self.spec_hash = spec.spec_hash()
        self.config = config
        self.worker = worker
        worker.step_limit = config.max_steps
        self.compute, self.transport, self.guard, self.stats = (services.compute, services.transport,
                                                                services.guard, services.stats)
        self.wire = services.wire or services.compute
        self.gate = gate
        self.next_peers = next_peers  # live, callable peers of the next stage
        self.stopping = stopping
        self.loader: ShardedBatches | None = None
        self.queue = 0  # forward requests being served
        self.in_flight = 0  # our own micro-batches in the pipeline (stage 0)
        self.window = InFlightWindow(config.max_in_flight)
        self.served = ServedRate()  # a later stage: the pace of its answers
        self.unheld_window = 0  # stage 0: the window as measured, before a round's payload holds it
        self.window_size = 0  # stage 0: the window as last sized and the last hop's deadline (/api/status)
        self.hop_deadline_s = 0.0
        self._turns = FairTurns()  # the previous stage's peers share our compute in turn
        self._own_output_logged = False
        self._slot_freed = asyncio.Event()  # one of our micro-batches is done (stage 0)
        self.waiting_for_next_stage = False  # stage 0 with no next-stage peer to send to
        self.throughput = 0.0  # samples/s, as our record reports it
        self.loss_seen: float | None = None  # EMA of the losses the last stage reports back to us
        # the magnitude screen for what the previous stage sends (train/screen.py): wire thread only
        self._activation_screen = MagnitudeScreen(config.max_activation_ratio, window=64)
        per_activation = spec.batch_size * spec.seq_len * worker.model_config.hidden_size * 4
        self.max_request_bytes = 4 * per_activation + (1 << 20)
        self.frame_limits = FrameLimits(max_payload_bytes=self.max_request_bytes)
        self.next_hop = NextHop(spec=spec, config=config, worker=worker, services=services,
                                next_peers=next_peers, frame_limits=self.frame_limits)

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        if not self.worker.is_first:
            await transport.serve(protocols.FORWARD, self.handle_forward,
                                  ServeLimits(max_request_bytes=self.max_request_bytes,
                                              max_per_peer=FORWARD_PER_CALLER,
                                              max_concurrent=self.config.max_queue,
                                              handler_timeout_s=self._handler_timeout_s(), paced_request=True,
                                              paced_response=True),
                                  authorize=authorize)

    def _handler_timeout_s(self) -> float:
        """A last stage only computes; a middle one hops on within what its caller asked."""
        return self.config.hop_timeout_s * 2 if self.worker.is_last else self.config.max_hop_deadline_s * 1.1

    # -- stage 0 -----------------------------------------------------------------------
    def open_data(self, data: RunData, peer_id: str, resumed: dict | None,
                  claims: Callable[[], dict[str, int]] = dict) -> ShardedBatches | SlotBatches:
        """The shard this node reads: --data-shard, else the one it read before a
        restart, else the one its peer id hashes to (a prepared dataset: a slot that
        ``claims``, peer -> slot, leaves free)."""
        if self.config.data_shard is None and resumed is not None:
            shard_id, num_shards = resumed["shard"]
        else:
            shard_id, num_shards = self.config.data_shard or (_shard_of(peer_id, SHARDS_BY_PEER_ID),
                                                              SHARDS_BY_PEER_ID)
        self.loader = data.open_loader(peer_id=peer_id, batch_size=self.spec.batch_size,
                                       shard=(shard_id, num_shards), resumed=resumed, claims=claims)
        return self.loader

    def data_position(self) -> dict | None:
        """For a checkpoint: where in its shard this node reads (stage 0 only)."""
        if self.loader is None:
            return None
        return {"shard": list(self.loader.part), **self.loader.state_dict()}

    async def produce(self, finished: Callable[[], Awaitable[None]]) -> None:
        """Stage 0: keep the window's worth of micro-batches in the pipeline until
        max_steps (or until stopped); then ``finished()``: stage 0 drives the run."""
        loader = self.loader
        # Micro-batches that finish during an outer round merge into one step, so after
        # draining the pipeline top up until the step count is really reached.
        while not self.reached_max_steps():
            async with asyncio.TaskGroup() as tg:
                while not self.issued_enough():
                    await self.gate.idle.wait()
                    await self._next_stage_known()
                    await self._free_slot()
                    if self.issued_enough() or self.stopping.is_set():
                        break
                    await loader.ready()
                    inputs, targets = await self.compute(loader.next_batch)
                    self.in_flight += 1
                    tg.create_task(self._run_microbatch(inputs, targets))
            await self.gate.idle.wait()
            if not self.reached_max_steps():
                # Gradients owed to the last steps wait for the step after a round. Take it
                # here, on the compute thread: looping back without awaiting anything would
                # spin on the event loop and starve the round that is meant to take it.
                await self.step_if_ready()
        await finished()

    async def _free_slot(self) -> None:
        """Wait for room in the window; the time waited is the link's (and the stages after)."""
        clock = asyncio.get_running_loop().time
        # link-bound, our hops keep to one peer (routing/sticky.py): one more than it takes
        # from us would go to another caller's peer and halve both bodies there
        accepts = (self.config.max_in_flight if self.worker.is_last
                   else FORWARD_PER_CALLER if self.next_hop.uplink.judge(clock(), self.window.paced_share())
                   else len(self.next_peers()) * FORWARD_PER_CALLER)
        waited_from = None
        while self.in_flight >= (size := self._window(accepts)):
            self.window_size = size
            waited_from = clock() if waited_from is None else waited_from
            self._slot_freed.clear()
            await self._slot_freed.wait()
        self.window_size = size
        if waited_from is not None:
            self.stats.link_wait_s += clock() - waited_from

    def _window(self, accepts: int) -> int:
        """The measured window, held to ROUND_WINDOW while a round's payload moves."""
        self.unheld_window = size = self.window.size(accepts)
        return min(size, ROUND_WINDOW) if self.gate.payload_on_link() else size

    def _hop_flights(self) -> int:
        """What a hop's deadline counts as crossing the link with it: the window as measured,
        not only ours in flight now. Paced flows share the link alike, so micro-batches sent
        after this one slow it down as the window fills (a run's first hop, sent alone with
        the deadline of one, was lost once the window grew to 3), and while a payload holds
        the window, the payload takes the place of those held back."""
        return max(self.in_flight, self.unheld_window)

    def uplink_bytes_s(self) -> float | None:
        """What our uplink carries of the pipeline, bytes a second, as measured here: stage
        0's requests at its delivery rate (routing/window.py), a later stage's answers at
        the pace it served them; None until measured. The outer exchange's deadline
        stretches with it (gossip/exchange_times.py)."""
        rate, crossed = ((self.window.link_rate(), self.stats.to_next) if self.worker.is_first
                         else (self.served.rate(), self.stats.from_previous))
        if rate is None or not crossed.tokens:
            return None
        return rate * crossed.sent * self.spec.batch_size * self.spec.seq_len / crossed.tokens

    async def _next_stage_known(self) -> None:
        """Stage 0 draws a micro-batch only while some next-stage peer can take it: the
        first volunteer of a run (or one whose next-stage peers are all backed off) waits
        for one instead of losing a micro-batch every hop deadline. Polled: peers appear
        through the registry loop and bans lapse with time."""
        if self.worker.is_last or self.next_peers():
            return
        self.waiting_for_next_stage = True
        log.info("waiting for a stage-%d peer: none is known yet (or all are backed off)",
                 self.worker.stage.stage_index + 1)
        while not self.next_peers() and not self.stopping.is_set():
            await asyncio.sleep(NEXT_STAGE_POLL_S)
        self.waiting_for_next_stage = False

    def reached_max_steps(self) -> bool:
        limit = self.config.max_steps
        return self.stopping.is_set() or (limit is not None and self.worker.inner_step >= limit)

    def issued_enough(self) -> bool:
        """Stage 0 has issued enough micro-batches for max_steps, counting those in flight
        and gradients that arrived during an outer round and wait for the step after it."""
        limit = self.config.max_steps
        if limit is None:
            return self.stopping.is_set()
        samples = self.in_flight * self.spec.batch_size + self.worker.pending_samples
        return self.worker.inner_step + samples / self.spec.samples_per_step >= limit

    async def _run_microbatch(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        try:
            started = time.perf_counter()
            if self.worker.is_last:  # a single-stage run
                (_, _, due), compute_s = await self.compute(timed, last_stage_step, self.worker, None,
                                                            targets,
                                                            None, inputs)
                wait_s = 0.0
            else:
                if self.worker.boundary is not None:  # the window's ids travel instead of the targets
                    targets = window_ids(inputs, targets)
                clock = asyncio.get_running_loop().time
                mark = self.window.sent(clock())
                deadline_s = self.window.deadline_s(self._hop_flights(), self.config.hop_timeout_s,
                                                    self.config.max_hop_deadline_s)
                self.hop_deadline_s = deadline_s
                try:
                    _, due, compute_s, wait_s, _ = await self._hop(inputs, targets, deadline_s)
                except MicrobatchLost:
                    return
                self.window.delivered(mark, clock())
            self.window.note(compute_s, wait_s)
            self.throughput = throughput_ema(self.throughput, len(inputs), time.perf_counter() - started)
            self.stats.microbatches_done += 1
            self.stats.tokens += inputs.numel()
            self.gate.note_due(due)
        finally:
            self.in_flight -= 1
            self._slot_freed.set()

    async def step_if_ready(self) -> None:
        """Step with what accumulated (e.g. gradients that arrived during a round)."""
        _, due = await self.compute(step_if_ready, self.worker)
        self.gate.note_due(due)

    # -- every stage but the first, given max_steps -----------------------------------------
    async def serve_to_the_limit(self, upstream_ended: Callable[[], Awaitable[bool]],
                                 finished: Callable[[], Awaitable[None]]) -> None:
        """Finish at max_steps, or once the stage before has ended after we trained: stages
        are not in lockstep, so its last micro-batches may never come.

        At the limit this stage steps no more but keeps answering until micro-batches stop
        coming: the stage before counts only micro-batches it got an answer for, so after
        a lost hop (we trained, the answer never reached it) it still needs answers we owe
        no step for. Leaving at once would strand it without a next-stage peer."""
        clock = asyncio.get_running_loop().time
        limit = self.config.max_steps
        upstream_checked = clock()
        reached_at: float | None = None
        answered, answered_at = self.stats.microbatches_done, clock()
        while True:
            await asyncio.sleep(FINISH_POLL_S)
            now = clock()
            if self.stats.microbatches_done != answered:
                answered, answered_at = self.stats.microbatches_done, now
            if self.worker.inner_step >= limit:
                if reached_at is None:
                    reached_at = now
                    log.info("reached inner step %d; answering the stage before until it needs no more",
                             limit)
                if now - answered_at >= QUIET_AT_LIMIT_S or now - reached_at >= LIMIT_GRACE_S:
                    break
            elif answered and now - upstream_checked >= UPSTREAM_CHECK_S:
                upstream_checked = now
                if await upstream_ended():
                    log.info("stage %d has ended its run; finishing at inner step %d",
                             self.worker.stage.stage_index - 1, self.worker.inner_step)
                    break
        await finished()

    # -- every stage but the last: the hop to the next stage --------------------------------
    async def _hop(self, inputs: torch.Tensor, targets: torch.Tensor, timeout_s: float,
                   codec: str | None = None, turn: Callable[[], AbstractAsyncContextManager] = nullcontext):
        """A micro-batch through this stage and on (stage 0's own, or one a middle stage
        serves): forward, the hop to a next-stage peer, backward and the inner step when
        due, each compute held in ``turn``. Returns (the gradient wrt ``inputs`` in
        ``codec``, or None; round due; compute s; wait s; the loss the last stage found).
        A lost micro-batch is counted here and raised as MicrobatchLost. ``targets``: the
        window's ids with a coded boundary (train/worker.py)."""
        async with turn():
            (outgoing, shape), forward_s = await self.compute(timed, forward_to_host, self.worker, inputs,
                                                              self.worker.wire_codec, targets)
        clock = asyncio.get_running_loop().time  # the wait is the link's: a test's virtual clock
        sent = clock()
        try:
            grad_out, loss = await self.next_hop.send(outgoing, shape, targets, timeout_s)
        except OwnOutputNotFinite as exc:
            self._own_output_not_finite(exc)
            raise MicrobatchLost("downstream: not finite") from exc
        except (PeerError, NotEnoughPeers, TimeoutError) as exc:
            self.stats.microbatches_lost += 1
            self.stats.note_failure(f"micro-batch lost: {exc}")
            log.info("micro-batch lost: %s (deadline %.0f s; %d of ours in flight, window %d, %s)", exc,
                     timeout_s, self.in_flight, self.window_size, self.window.pace())
            raise MicrobatchLost(f"downstream: {exc}") from exc
        self._note_loss(loss)
        wait_s = clock() - sent
        async with turn():
            (grad, due), backward_s = await self.compute(timed, backward_step, self.worker, inputs, grad_out,
                                                         codec, targets)
        return grad, due, forward_s + backward_s, wait_s, loss

    def _own_output_not_finite(self, exc: OwnOutputNotFinite) -> None:
        """Our own activations are not finite: the micro-batch is lost, nothing is sent
        (the next stage would count it against us and stop taking ours: in a run whose
        stage 0 went so, stage 1 refused every stage-0 peer for 30 minutes). Said once."""
        self.stats.microbatches_lost += 1
        self.stats.note_failure(f"micro-batch lost: {exc}")
        if not self._own_output_logged:
            self._own_output_logged = True
            log.error(
                "this node's own activations are not finite (%s): micro-batches are not sent; its weights "
                "may have diverged (a lower learning rate, or restarting it to take the stage's state, "
                "helps)",
                exc,
            )

    def _note_loss(self, loss: float) -> None:
        self.loss_seen = loss if self.loss_seen is None else 0.95 * self.loss_seen + 0.05 * loss

    # -- every stage but the first: serving the previous one -------------------------------
    async def handle_forward(self, remote: str, request: bytes) -> bytes:
        """Activations + targets in; gradient wrt those activations + loss out."""
        if self.stopping.is_set() or self.queue >= self.config.max_queue:
            return encode_frame({"ok": False, "error": "busy"})
        self.queue += 1
        try:
            deadline_s, hidden, targets = await self.wire(self._decode_forward, request)
            started = time.perf_counter()
            budget = min(deadline_s, self.config.max_hop_deadline_s)  # what the caller asked, capped
            codec = self.worker.wire_codec
            if self.worker.is_last:
                async with self._turns.turn(remote):
                    loss, grad, due = await self.compute(last_stage_step, self.worker, hidden, targets, codec)
            else:
                grad, due, _, _, loss = await self._hop(hidden, targets, budget * 0.9, codec,
                                                        turn=partial(self._turns.turn, remote))
            self.throughput = throughput_ema(self.throughput, len(hidden), time.perf_counter() - started)
            self.stats.microbatches_done += 1
            self.gate.note_due(due)
            answer = await self.wire(encode_answer, {"ok": True, "loss": loss}, grad)
            self.stats.from_previous.note(len(answer), len(request), targets.numel())
            self.served.note(asyncio.get_running_loop().time())
            return answer
        except OutOfScale as exc:  # refused, not counted against the sender
            self.guard.note(remote, f"refusing a micro-batch of {short_id(remote)}: {exc}")
            return encode_frame({"ok": False, "error": f"out of scale: {exc}"[:200]})
        except ProtocolError as exc:
            self.guard.fault(remote, f"bad forward request ({exc})")
            return encode_frame({"ok": False, "error": f"protocol: {exc}"[:200]})
        except MicrobatchLost as exc:
            return encode_frame({"ok": False, "error": str(exc)[:200]})
        finally:
            self.queue -= 1

    def _decode_forward(self, request: bytes) -> tuple[float, torch.Tensor, torch.Tensor]:
        """On the wire thread: parse a forward request, check it fits this stage, and
        screen the scale of the activations (or of the code of a coded boundary). Returns
        (deadline s, activations or code, targets or, coded, the window's ids)."""
        header, tensors = decode_frame(request, self.frame_limits)
        model, boundary = self.worker.model_config, self.worker.boundary
        limits = dict(spec_hash=self.spec_hash, max_batch=4 * self.spec.batch_size, max_seq=self.spec.seq_len,
                      default_deadline_s=self.config.hop_timeout_s)
        if boundary is not None:
            deadline_s, hidden, inputs, targets = coded.check_forward_request(header, tensors, boundary,
                                                                              **limits)
            targets = window_ids(inputs, targets)
        else:
            deadline_s, hidden, targets = check_forward_request(
                header, tensors, hidden_size=model.hidden_size, vocab_size=model.vocab_size,
                codec=self.spec.activation_codec, **limits)
        problem = self._activation_screen.check(rms(hidden), "activation RMS")
        if problem:
            raise OutOfScale(problem)
        return deadline_s, pinned_for(hidden, self.worker.device), targets


def _shard_of(peer_id: str, num_shards: int) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "little") % num_shards

"""The data path: where a micro-batch goes and what comes back.

Stage 0 draws micro-batches from its data shard and keeps as many of them in the
pipeline as keep its compute busy (routing/window.py); each is run through this stage
and sent to a next-stage peer (routing/chooser.py picks it), which does the same until
the last stage computes the loss and the gradients travel back the same way. Every stage steps its inner
optimizer when enough samples are in (train/worker.py) and hands over to the outer
round when one is due (train/rounds.py).

A failed hop is retried with another peer within the micro-batch's deadline; the
failed peer is banned (net/guard.py), except for a single stream reset, which is
retried at once. A micro-batch whose deadline passes is lost and counted.

Forwards, backwards and steps run on the compute thread; encoding and decoding what
crosses the boundary runs on the wire thread beside it (train/compute.py), the bytes
move on the event loop and the lanes' threads (net/), so the next micro-batch computes
while this one travels."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from swarm_node.data.sharded_batches import ShardedBatches
from swarm_node.data.slot_batches import SlotBatches
from swarm_node.data.source import RunData
from swarm_node.errors import (
    NotEnoughPeers,
    OutOfScale,
    OwnOutputNotFinite,
    PeerError,
    PeerRefused,
    ProtocolError,
    StreamClosed,
)
from swarm_node.net import protocols
from swarm_node.net.transport import ServeLimits, short_id
from swarm_node.node_config import NodeConfig
from swarm_node.node_services import NodeServices
from swarm_node.routing.chooser import Candidate, PeerChooser, RoundTrips
from swarm_node.routing.window import InFlightWindow
from swarm_node.spec import RunSpec
from swarm_node.train.compute import FairTurns
from swarm_node.train.host_copy import HostCopy, pinned_for, to_host
from swarm_node.train.rounds import RoundGate, step_if_ready
from swarm_node.train.screen import MagnitudeScreen
from swarm_node.train.worker import StageWorker, throughput_ema
from swarm_node.wire.activations import encode_activations
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame, finite
from swarm_node.wire.messages import check_forward_request, decode_gradient_answer, rms
from swarm_node.wire.records import PeerRecord

log = logging.getLogger(__name__)

NEXT_STAGE_POLL_S = 0.5
FINISH_POLL_S = 1.0
UPSTREAM_CHECK_S = 5.0  # a DHT read: how often a later stage given max_steps asks whether the run is over
QUIET_AT_LIMIT_S = 3.0  # at max_steps, no micro-batch for this long: the stage before needs no more answers
LIMIT_GRACE_S = 30.0  # at most this long answering past max_steps (a stage 0 with no limit never stops sending)
SHARDS_BY_PEER_ID = 1024  # a node without --data-shard reads the shard its peer id hashes to
# Forward requests a node serves at once for one caller (more are answered busy): a node
# sends no more than this to one next-stage peer at a time, whatever its window.
FORWARD_PER_CALLER = 4
HOP_FREED_POLL_S = 0.02  # how often a hop that found every next-stage peer at that cap looks again


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
        self.chooser = PeerChooser(is_banned=self.guard.is_banned)
        self.round_trips = RoundTrips()  # what our hops to each next-stage peer measured
        self.loader: ShardedBatches | None = None
        self.queue = 0  # forward requests being served
        self.in_flight = 0  # our own micro-batches in the pipeline (stage 0)
        self.window = InFlightWindow(config.max_in_flight)
        self._turns = FairTurns()  # the previous stage's peers share our compute in turn
        self._own_output_logged = False
        self._slot_freed = asyncio.Event()  # one of our micro-batches is done (stage 0)
        self.waiting_for_next_stage = False  # stage 0 with no next-stage peer to send to
        self.throughput = 0.0  # samples/s, as our record reports it
        self.loss_seen: float | None = None  # EMA of the losses the last stage reports back to us
        # Magnitude screens for what neighbours send (train/screen.py): used on the wire thread only.
        self._activation_screen = MagnitudeScreen(config.max_activation_ratio, window=64)
        self._gradient_screen = MagnitudeScreen(config.max_activation_ratio, window=64)
        per_activation = spec.batch_size * spec.seq_len * worker.model_config.hidden_size * 4
        self.max_request_bytes = 4 * per_activation + (1 << 20)
        self.frame_limits = FrameLimits(max_payload_bytes=self.max_request_bytes)

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        if not self.worker.is_first:
            await transport.serve(protocols.FORWARD, self.handle_forward,
                                  ServeLimits(max_request_bytes=self.max_request_bytes, max_per_peer=FORWARD_PER_CALLER,
                                              max_concurrent=self.config.max_queue,
                                              handler_timeout_s=self.config.hop_timeout_s * 2),
                                  authorize=authorize)

    # -- stage 0 -----------------------------------------------------------------------
    def open_data(self, data: RunData, peer_id: str, resumed: dict | None,
                  claims: Callable[[], dict[str, int]] = dict) -> ShardedBatches | SlotBatches:
        """The shard this node reads: --data-shard, else the one it read before a
        restart, else the one its peer id hashes to (a prepared dataset: a slot that
        ``claims``, peer -> slot, leaves free)."""
        if self.config.data_shard is None and resumed is not None:
            shard_id, num_shards = resumed["shard"]
        else:
            shard_id, num_shards = self.config.data_shard or (_shard_of(peer_id, SHARDS_BY_PEER_ID), SHARDS_BY_PEER_ID)
        self.loader = data.open_loader(peer_id=peer_id, batch_size=self.spec.batch_size, shard=(shard_id, num_shards),
                                       resumed=resumed, claims=claims)
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
        accepts = self.config.max_in_flight if self.worker.is_last else len(self.next_peers()) * FORWARD_PER_CALLER
        while self.in_flight >= self.window.size(accepts):
            self._slot_freed.clear()
            await self._slot_freed.wait()

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
                (_, _, due), compute_s = await self.compute(_timed, _last_stage_step, self.worker, None, targets,
                                                            None, inputs)
                wait_s = 0.0
            else:
                (outgoing, shape), forward_s = await self.compute(_timed, _forward_to_host, self.worker, inputs,
                                                                  self.spec.activation_codec)
                sent = time.perf_counter()
                try:
                    grad, loss = await self.send_downstream(outgoing, shape, targets, self.config.hop_timeout_s)
                    self._note_loss(loss)
                except OwnOutputNotFinite as exc:
                    self._own_output_not_finite(exc)
                    return
                except (PeerError, NotEnoughPeers, TimeoutError) as exc:
                    self.stats.microbatches_lost += 1
                    self.stats.note_failure(f"micro-batch lost: {exc}")
                    log.info("micro-batch lost: %s", exc)
                    return
                wait_s = time.perf_counter() - sent
                (_, due), backward_s = await self.compute(_timed, _backward_step, self.worker, inputs, grad)
                compute_s = forward_s + backward_s
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
                    log.info("reached inner step %d; answering the stage before until it needs no more", limit)
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
    async def send_downstream(self, outgoing: HostCopy, shape: torch.Size, targets: torch.Tensor,
                              timeout_s: float) -> tuple[torch.Tensor, float]:
        """Send activations (of ``shape``, encoded by the run's codec, on their way to the
        host) to a next-stage peer; returns (grad wrt them, loss). Retries other peers on
        failure, banning the failed one."""
        next_stage = self.worker.stage.stage_index + 1
        clock = asyncio.get_running_loop().time  # time.monotonic, or a test's virtual clock
        deadline = clock() + timeout_s
        payload = await self.wire(_encode_forward, {"kind": "fwd", "spec": self.spec_hash, "deadline_s": timeout_s},
                                  outgoing, targets)
        tried: set[str] = set()
        attempts = 0
        while True:
            remaining = deadline - clock()
            if remaining <= 0 or attempts > self.config.hop_retries:
                raise NotEnoughPeers(f"no stage-{next_stage} peer completed the micro-batch after {attempts} attempts")
            # one unverified peer at most per micro-batch: a flood of forged records cannot use up its attempts
            probe = not any(not self.guard.is_verified(p) for p in tried)
            peer = self.chooser.choose(self._candidates(probe), exclude=tried, per_peer=FORWARD_PER_CALLER)
            if peer is None:  # none known, all tried, or all as busy with us as they take
                busy = any(n >= FORWARD_PER_CALLER for n in self.chooser.in_flight.values())
                # the registry loop may show someone by then; a hop of ours ends soon
                await asyncio.sleep(min(HOP_FREED_POLL_S if busy else 0.5, remaining))
                tried.clear()
                continue
            attempts += 1
            if attempts > 1:
                self.stats.retries += 1
            self.chooser.started(peer)
            try:
                sent = clock()
                raw = await self.transport.request(peer, protocols.FORWARD, payload, timeout_s=remaining,
                                                   max_response_bytes=len(payload) + (1 << 16))
                grad, loss = await self.wire(self._check_gradient, raw, shape)
                self.guard.succeeded(peer)
                self.round_trips.note(peer, shape[0], clock() - sent)
                return grad, loss
            except PeerRefused as exc:
                tried.add(peer)
                log.debug("stage-%d peer %s refused: %s", next_stage, short_id(peer), exc)
            except OutOfScale as exc:  # this micro-batch only: the peer is not at fault
                tried.add(peer)
                self.guard.note(peer, f"stage-{next_stage} peer {short_id(peer)}: {exc}; micro-batch sent elsewhere")
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
                self.chooser.finished(peer)

    def _candidates(self, probe: bool = True) -> list[Candidate]:
        """Next-stage peers to route to, weighted by what we measured (and how lately:
        routing/chooser.py), not by what their records claim (anyone can sign a record
        claiming any throughput): verified peers, and at most one unverified one to probe
        (net/guard.py)."""
        records = self.next_peers()
        self.round_trips.keep_only(records)
        return [self.round_trips.candidate(p, min(records[p].queue, self.config.max_queue))
                for p in self.guard.probe_set(list(records), self.chooser.rng, probe=probe)]

    def _peer_failed(self, stage: int, peer: str, why: str) -> None:
        ban_s = self.guard.failed(peer)
        self.stats.note_failure(f"stage-{stage} peer {short_id(peer)} failed: {why}")
        self.guard.note(peer, f"stage-{stage} peer {short_id(peer)} failed ({why}); banned for {ban_s:.0f}s")

    def _check_gradient(self, raw: bytes, shape: torch.Size) -> tuple[torch.Tensor, float]:
        """On the wire thread: the next stage's answer, checked and screened."""
        grad, loss = decode_gradient_answer(raw, self.frame_limits, shape, self.spec.activation_codec)
        problem = self._gradient_screen.check(rms(grad), "gradient RMS")
        if problem:
            raise OutOfScale(problem)
        return pinned_for(grad, self.worker.device), loss

    def _own_output_not_finite(self, exc: OwnOutputNotFinite) -> None:
        """Our own activations are not finite: the micro-batch is lost, nothing is sent
        (the next stage would count it against us and stop taking ours: in a run whose
        stage 0 went so, stage 1 refused every stage-0 peer for 30 minutes). Said once."""
        self.stats.microbatches_lost += 1
        self.stats.note_failure(f"micro-batch lost: {exc}")
        if not self._own_output_logged:
            self._own_output_logged = True
            log.error("this node's own activations are not finite (%s): micro-batches are not sent; its weights may "
                      "have diverged (a lower learning rate, or restarting it to take the stage's state, helps)", exc)

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
            budget = min(deadline_s, self.config.hop_timeout_s)
            codec = self.spec.activation_codec
            if self.worker.is_last:
                async with self._turns.turn(remote):
                    loss, grad, due = await self.compute(_last_stage_step, self.worker, hidden, targets, codec)
            else:
                async with self._turns.turn(remote):
                    outgoing, shape = await self.compute(_forward_to_host, self.worker, hidden, codec)
                grad_out, loss = await self.send_downstream(outgoing, shape, targets, budget * 0.9)
                self._note_loss(loss)
                async with self._turns.turn(remote):
                    grad, due = await self.compute(_backward_step, self.worker, hidden, grad_out, codec)
            self.throughput = throughput_ema(self.throughput, len(hidden), time.perf_counter() - started)
            self.stats.microbatches_done += 1
            self.gate.note_due(due)
            return await self.wire(_encode_answer, {"ok": True, "loss": loss}, grad)
        except OutOfScale as exc:  # refused, not counted against the sender
            self.guard.note(remote, f"refusing a micro-batch of {short_id(remote)}: {exc}")
            return encode_frame({"ok": False, "error": f"out of scale: {exc}"[:200]})
        except ProtocolError as exc:
            self.guard.fault(remote, f"bad forward request ({exc})")
            return encode_frame({"ok": False, "error": f"protocol: {exc}"[:200]})
        except OwnOutputNotFinite as exc:
            self._own_output_not_finite(exc)
            return encode_frame({"ok": False, "error": "downstream: not finite"})
        except (PeerError, NotEnoughPeers, TimeoutError) as exc:
            self.stats.microbatches_lost += 1
            return encode_frame({"ok": False, "error": f"downstream: {exc}"[:200]})
        finally:
            self.queue -= 1

    def _decode_forward(self, request: bytes) -> tuple[float, torch.Tensor, torch.Tensor]:
        """On the wire thread: parse a forward request, check it fits this stage, and
        screen the activations' scale."""
        header, tensors = decode_frame(request, self.frame_limits)
        model = self.worker.model_config
        deadline_s, hidden, targets = check_forward_request(
            header, tensors, spec_hash=self.spec_hash, hidden_size=model.hidden_size,
            max_batch=4 * self.spec.batch_size, max_seq=self.spec.seq_len, vocab_size=model.vocab_size,
            default_deadline_s=self.config.hop_timeout_s, codec=self.spec.activation_codec)
        problem = self._activation_screen.check(rms(hidden), "activation RMS")
        if problem:
            raise OutOfScale(problem)
        return deadline_s, pinned_for(hidden, self.worker.device), targets


# -- on the compute thread: the device work, its results queued towards the host ----------
def outgoing(t: torch.Tensor, codec: str) -> tuple[HostCopy, torch.Size]:
    """Activations or their gradient as ``codec`` sends them, on their way to the host,
    and their shape."""
    return to_host(encode_activations(t, codec)), t.shape


def _forward_to_host(worker: StageWorker, inputs: torch.Tensor, codec: str) -> tuple[HostCopy, torch.Size]:
    return outgoing(worker.forward(inputs), codec)


def _last_stage_step(worker: StageWorker, hidden, targets, codec: str | None, token_inputs=None):
    """Loss, backward and (when due) the inner step, as one unit; the gradient encoded by
    ``codec`` on its way to the host (None for a single-stage run: nothing to send)."""
    loss, grad = worker.forward_backward_last(hidden, targets, token_inputs)
    _, due = step_if_ready(worker)
    return loss, None if codec is None else outgoing(grad, codec)[0], due


def _backward_step(worker: StageWorker, inputs, grad_output, codec: str | None = None):
    grad = worker.backward(inputs, grad_output)
    _, due = step_if_ready(worker)
    return None if codec is None else outgoing(grad, codec)[0], due


def _timed(fn, *args):
    """``fn(*args)`` and the seconds it took, measured on the thread that runs it."""
    started = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - started


# -- on the wire thread ----------------------------------------------------------------------
def _encode_forward(header: dict, host: HostCopy, targets: torch.Tensor) -> bytes:
    """The forward request; OwnOutputNotFinite if our activations are not finite (checked
    here, on the host copy, so the device is never waited for)."""
    tensors = host.wait()
    for t in tensors:
        if t.is_floating_point() and not finite(t):
            nan = int(torch.isnan(t).sum())
            raise OwnOutputNotFinite(f"{nan} NaN and {int(torch.isinf(t).sum())} infinite values among {t.numel()} "
                                     f"of our {t.dtype} activations")
    return encode_frame(header, [*tensors, targets.to(torch.int32)])


def _encode_answer(header: dict, host: HostCopy) -> bytes:
    return encode_frame(header, host.wait())


def forward_request(header: dict, hidden: torch.Tensor, targets: torch.Tensor, codec: str) -> bytes:
    """A whole forward request in one call (tests, benchmarks)."""
    return _encode_forward(header, outgoing(hidden, codec)[0], targets)


def _shard_of(peer_id: str, num_shards: int) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "little") % num_shards

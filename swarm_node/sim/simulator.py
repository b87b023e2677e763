"""An in-process swarm: R workers per stage x S stages, trained with the real inner and
outer optimizers and the same per-micro-batch random routing the networked swarm uses.

Every step, each stage-0 worker draws one micro-batch from its own data shard; at every
stage boundary the micro-batches are dealt to a fresh random permutation of the next
stage's workers (each worker serves one, as in the NoLoCo reference), with the target
ids travelling along. Activations and gradients cross the boundary detached (and cast
to the wire dtype), exactly as they would between processes, and gradients return
along the same path.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from swarm_node.data.dataset import TokenWindows, load_windows
from swarm_node.data.sharded_batches import ShardedBatches
from swarm_node.model.coded import coded_model
from swarm_node.model.config import ModelConfig, model_config
from swarm_node.model.memory import StageMemory, estimate_stage_memory
from swarm_node.model.stages import PipelineStage, build_stage
from swarm_node.optim.ddp import average_gradients
from swarm_node.optim.inner import InnerOptimizer
from swarm_node.optim.outer import SlowWeights
from swarm_node.sim.config import SimConfig
from swarm_node.sim.grouping import random_groups
from swarm_node.train.device import device_facts_or_name, is_out_of_memory, out_of_memory
from swarm_node.train.evaluate import average_into, path_val_loss, random_paths_val_loss, weight_spread
from swarm_node.wire import boundary as coded
from swarm_node.wire.activations import decode_activations, encode_activations
from swarm_node.wire.frames import decode_frame
from swarm_node.wire.outer_codec import OuterEncoder, decode_outer, outer_codec


@dataclass
class Worker:
    stage: PipelineStage
    inner: InnerOptimizer
    slow: SlowWeights | None
    encoder: OuterEncoder | None = None  # how its (phi, Delta) go on the wire, with error feedback


@dataclass
class InFlight:
    """An overlapped round under way: every stage's groups and payloads, and the steps
    its parts land at (``deltas_at``: a Delta sent ahead of phi; None once in, or when
    the payload lands whole)."""
    sent: list
    deltas_at: int | None
    lands_at: int


@dataclass
class StepReport:
    step: int
    tokens: int
    train_loss: float
    val_loss: float | None
    elapsed_s: float


@dataclass
class SimResult:
    config: SimConfig
    final_val_loss: float
    final_consensus_val_loss: float
    val_loss_curve: list[tuple[int, float]]
    train_loss_curve: list[tuple[int, float]]
    replica_weight_std: list[float]
    tokens: int
    wall_s: float
    entropy_floor: float | None
    num_parameters: int
    outer_rounds: int = 0
    extra: dict = field(default_factory=dict)


class Simulator:
    def __init__(self, config: SimConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.rng = np.random.default_rng([config.seed, 0x73696D])
        needed = config.steps * config.batch_size * config.replicas
        self.data: TokenWindows = load_windows(config.data, config.seq_len, min_train_windows=needed)
        layers = {} if config.num_layers is None else {"num_layers": config.num_layers}
        self.model_config = model_config(config.model_size, vocab_size=self.data.vocab_size,
                                         max_seq_len=config.seq_len, **layers)
        # a coded boundary (wire/boundary.py), built as the node builds it (model/coded.py)
        self.model_config, self.boundary = coded_model(
            self.model_config, activation_codec=config.activation_codec,
            activation_ratio=config.activation_ratio, batch_size=config.batch_size, seq_len=config.seq_len,
            num_stages=config.stages, layers_per_stage=config.layers_per_stage)
        with self._oom_explained():
            self.workers = [
                [self._build_worker(s) for _ in range(config.replicas)] for s in range(config.stages)
            ]
        self.loaders = [ShardedBatches(self.data, batch_size=config.batch_size, seed=config.seed,
                                       shard_id=r,
                                       num_shards=config.replicas) for r in range(config.replicas)]
        self.outer_rounds = 0
        self._in_flight: InFlight | None = None

    def _build_worker(self, stage_index: int) -> Worker:
        cfg = self.config
        stage = build_stage(self.model_config, num_stages=cfg.stages, stage_index=stage_index, seed=cfg.seed,
                            layers_per_stage=cfg.layers_per_stage, device=self.device)
        if cfg.freeze_input_embedding and stage_index == 0:
            stage.model.embed_tokens.weight.requires_grad_(False)  # the inner optimizer leaves it out
        params = list(stage.parameters())
        slow = SlowWeights(params, cfg.method.outer) if cfg.method.has_outer_step else None
        encoder = OuterEncoder(outer_codec(cfg.outer_codec)) if slow is not None else None
        return Worker(stage=stage, inner=InnerOptimizer(params, cfg.inner), slow=slow, encoder=encoder)

    @contextlib.contextmanager
    def _oom_explained(self):
        """Out of memory becomes one line with the estimate and what to change."""
        try:
            yield
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            cfg = self.config
            need = simulator_memory(cfg, self.model_config)
            what = (
                f"{cfg.replicas} replicas x {cfg.stages} stages of the {cfg.model_size} model in one process "
                f"({need.parameters / 1e6:,.1f}M parameters in all)"
            )
            raise out_of_memory(device_facts_or_name(self.device), what, need, batch_size=cfg.batch_size,
                                seq_len=cfg.seq_len, tries=["a smaller --model", "fewer --replicas",
                                                            "a smaller --batch-size or --seq-len"]) from exc

    # -- one step ---------------------------------------------------------------
    def _paths(self) -> list[list[int]]:
        """paths[s][m]: the worker of stage s that serves micro-batch m."""
        r = self.config.replicas
        identity = list(range(r))
        if self.config.routing == "fixed":
            return [identity] * self.config.stages
        return [identity] + [[int(i) for i in self.rng.permutation(r)] for _ in range(1, self.config.stages)]

    def _cross_boundary(self, tensor: torch.Tensor) -> torch.Tensor:
        """What the next stage (or, for a gradient, the previous one) decodes, as a node
        sends it (wire/messages.py)."""
        codec = self.config.activation_codec
        sent = encode_activations(tensor.detach().cpu(), codec)
        return decode_activations(sent, tuple(tensor.shape), codec).to(tensor.device, tensor.dtype)

    def _forward_coded(self, code: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A coded boundary as the next stage decodes it from the node's forward request
        (wire/boundary.py): the code and the window's token ids."""
        raw = coded.forward_request({"kind": "fwd", "spec": "sim", "deadline_s": 1.0}, code.detach().cpu(),
                                    ids.cpu(), self.boundary)
        batch, seq = ids.shape[0], ids.shape[1] - 1
        _, got, inputs, targets = coded.check_forward_request(
            *decode_frame(raw), self.boundary, spec_hash="sim", max_batch=batch, max_seq=seq,
            default_deadline_s=1.0)
        return got.to(self.device), coded.window_ids(inputs, targets).to(self.device)

    def _gradient_coded(self, grad: torch.Tensor) -> torch.Tensor:
        _, tensors = decode_frame(coded.gradient_answer({"ok": True, "loss": 0.0}, grad.cpu(), self.boundary))
        return coded.check_gradient(tensors, tuple(grad.shape), self.boundary).to(self.device)

    def _train_micro_batch(self, path: list[int], inputs: torch.Tensor, targets: torch.Tensor) -> float:
        boundary: list[tuple[torch.Tensor, torch.Tensor]] = []  # (stage input, stage output) per stage
        hidden = inputs.to(self.device)
        targets = targets.to(self.device)
        tokens = inputs.to(self.device)
        for s, w in enumerate(path):
            stage = self.workers[s][w].stage
            if s == 0:
                stage_input = hidden
            elif self.boundary is None:
                stage_input = self._cross_boundary(hidden).requires_grad_(True)
            else:  # the ids travel with the code: what the next stage reads is what it decoded
                stage_input, ids = self._forward_coded(hidden, coded.window_ids(tokens, targets))
                tokens, targets = ids[:, :-1], ids[:, 1:]
                stage_input.requires_grad_(True)
            output = stage(stage_input, targets if stage.is_last else None, tokens=tokens)
            boundary.append((stage_input, output))
            hidden = output
        loss = hidden
        loss.backward()
        for s in range(len(path) - 2, -1, -1):
            grad = boundary[s + 1][0].grad
            upstream_grad = (
                self._cross_boundary(grad) if self.boundary is None else self._gradient_coded(grad)
            )
            boundary[s][1].backward(upstream_grad)
        return float(loss.detach())

    def train_step(self) -> float:
        cfg = self.config
        paths = self._paths()
        losses = []
        for m in range(cfg.replicas):
            inputs, targets = self.loaders[m].next_batch()
            losses.append(self._train_micro_batch([paths[s][m] for s in range(cfg.stages)], inputs, targets))
        if cfg.method.name == "ddp":
            for stage_workers in self.workers:
                average_gradients([list(w.stage.parameters()) for w in stage_workers])
        for stage_workers in self.workers:
            for w in stage_workers:
                w.inner.step()
        return float(np.mean(losses))

    def outer_round(self) -> None:
        """The blocking round: every worker's payload at the boundary, applied at once."""
        self._land(self._exchange())

    def advance(self, step: int) -> float:
        """Inner step ``step`` (counted from 1), then the outer round it makes due, as
        configured: blocking, or overlapped (ALGORITHM.md 3.1: the payloads as encoded at
        the boundary land ``outer_latency_steps`` later, a Delta sent ahead of phi as far
        into that as its share of the bytes; one that outlasts a round lands at the next
        boundary, where the node waits for it, and a node that must wait waits first, for
        the Delta; the last one lands at the end).
        Returns the step's training loss."""
        cfg = self.config
        train_loss = self.train_step()
        if cfg.method.has_outer_step and step % cfg.method.inner_steps == 0:
            if self._in_flight is not None:
                self._land(self._in_flight.sent)
                self._in_flight = None
            if cfg.outer_latency_steps:
                self._in_flight = InFlight(self._exchange(), self._deltas_at(step),
                                           step + cfg.outer_latency_steps)
            else:
                self.outer_round()
        flight = self._in_flight
        if flight is not None:
            if step >= flight.lands_at or step == cfg.steps:
                self._land(flight.sent)
                self._in_flight = None
            elif flight.deltas_at is not None and step >= flight.deltas_at:
                self._land_deltas(flight.sent)
                flight.deltas_at = None
        return train_loss

    def _deltas_at(self, boundary: int) -> int | None:
        """The step after which the group's Delta, sent ahead of phi, lands (None: with the
        phi). An exchange of L steps' time outlasting the round's H steps makes the node
        wait L - H anyway; it spends that wait first, while the Delta comes (the node's
        round gate does it when the last exchange outlasted its steps), so the Delta
        lands that many steps sooner in the round, before the first if it is in by then."""
        cfg = self.config
        if cfg.outer_landing != "delta-first":
            return None
        latency, h = cfg.outer_latency_steps, cfg.method.inner_steps
        arrives = max(1, math.ceil(latency * outer_codec(cfg.outer_codec).delta_share() - 1e-9))
        after_steps = max(0, arrives - max(0, latency - h))
        return boundary + after_steps if after_steps < min(latency, h) else None

    def _exchange(self) -> list[tuple[list[list[int]], list[list], list | None]]:
        """Per stage: the groups, and every worker's (phi, Delta) as encoded at the
        boundary (and, when the round is overlapped, where each worker's inner steps
        beside the exchange start)."""
        cfg = self.config
        sent = []
        for stage_workers in self.workers:
            if cfg.method.name == "diloco":
                groups = [list(range(len(stage_workers)))]
            else:
                groups = random_groups(len(stage_workers), cfg.method.group_size, self.rng)
            payloads = []
            for w in stage_workers:
                payloads.append(w.encoder.encode(w.slow.phi, w.slow.deltas()))
                w.encoder.commit()  # a simulated exchange always completes
            starts = self._overlapped_starts(stage_workers, groups,
                                             payloads) if cfg.outer_latency_steps else None
            sent.append((groups, payloads, starts))
        return sent

    def _overlapped_starts(self, stage_workers: list[Worker], groups: list[list[int]],
                           payloads: list) -> list:
        """Where each worker's steps beside the exchange start (SimConfig.overlap_start),
        as :meth:`SlowWeights.start_overlapped` returns it."""
        how = self.config.overlap_start
        if how == "local":
            return [w.slow.start_overlapped() for w in stage_workers]
        if how == "theta":
            return [[p.detach().float().clone() for p in w.slow.params] for w in stage_workers]
        starts: list = [None] * len(stage_workers)
        for group in groups:
            for i in group:
                w = stage_workers[i]
                members = [self._decode(payloads[j], w) for j in [i] + [j for j in group if j != i]]
                own = ([w.slow.phi] * len(members), [w.slow.deltas()] * len(members))
                group_phi = [phi for phi, _ in members] if how in ("known-phis", "known") else own[0]
                group_delta = [delta for _, delta in members] if how in ("known-deltas", "known") else own[1]
                starts[i] = w.slow.start_overlapped(group_phi, group_delta)
        return starts

    def _decode(self, wire: list, receiver: Worker) -> tuple[list, list]:
        """A payload as ``receiver`` reads it (near codecs read phi against its own)."""
        shapes = [p.shape for p in receiver.stage.parameters()]
        return decode_outer(wire, shapes, receiver.encoder.codec, self.device, near=receiver.slow.phi)

    def _land_deltas(self, sent) -> None:
        """The groups' Delta in ahead of their phi: each worker's steps move onto the
        group's Delta step (SlowWeights.land_deltas), its start with them."""
        for stage_workers, (groups, payloads, starts) in zip(self.workers, sent):
            for group in groups:
                for i in group:
                    w = stage_workers[i]
                    deltas = [self._decode(payloads[j], w)[1] for j in [i] + [j for j in group if j != i]]
                    starts[i] = w.slow.land_deltas(deltas, starts[i])

    def _land(self, sent) -> None:
        for stage_workers, (groups, payloads, snapshots) in zip(self.workers, sent):
            for group in groups:
                # every member reads the group's payloads before any of them moves its phi
                received = {i: [self._decode(payloads[j],
                                             stage_workers[i]) for j in [i] + [j for j in group if j != i]]
                            for i in group}
                for i, members in received.items():  # each member lists itself first, then the others
                    slow = stage_workers[i].slow
                    stage_workers[i].encoder.observe(slow.phi, [phi for phi, _ in members[1:]])
                    group_phi, group_delta = [phi for phi, _ in members], [delta for _, delta in members]
                    if snapshots is None:
                        slow.apply(group_phi, group_delta)
                    else:
                        slow.apply_overlapped(group_phi, group_delta, snapshots[i])
        self.outer_rounds += 1

    # -- evaluation -------------------------------------------------------------
    def _eval_path(self, stages: list[PipelineStage]) -> float:
        cfg = self.config
        return path_val_loss(stages, self.data, batch_size=cfg.eval_batch_size, max_batches=cfg.eval_batches,
                             device=self.device)

    def evaluate(self) -> float:
        """Mean validation loss over the fixed paths 'worker r at every stage'."""
        return float(np.mean([self._eval_path([self.workers[s][r].stage for s in range(self.config.stages)])
                              for r in range(self.config.replicas)]))

    def evaluate_random_paths(self, seed: int = 0, max_batches: int | None = None) -> float:
        """Mean validation loss over random paths (as many per batch as there are
        replicas, so it costs what ``evaluate`` does), the same draws for any run with
        the same ``seed``; on the first ``max_batches`` batches (default: the config's)."""
        cfg = self.config
        return random_paths_val_loss([[w.stage for w in workers] for workers in self.workers], self.data,
                                     batch_size=cfg.eval_batch_size,
                                     max_batches=max_batches or cfg.eval_batches,
                                     paths_per_batch=cfg.replicas, seed=seed, device=self.device)

    def consensus_stages(self) -> list[PipelineStage]:
        """One model whose every stage is the mean of its workers' weights."""
        return [average_into(build_stage(self.model_config, num_stages=self.config.stages, stage_index=s,
                                         seed=self.config.seed, layers_per_stage=self.config.layers_per_stage,
                                         device=self.device), [w.stage for w in stage_workers])
                for s, stage_workers in enumerate(self.workers)]

    def replica_weight_std(self) -> list[float]:
        """Per stage: RMS over all parameter elements of the std across workers."""
        return [weight_spread([w.stage for w in stage_workers]) for stage_workers in self.workers]

    # -- the run ----------------------------------------------------------------
    def run(self, on_step: Callable[[StepReport], None] | None = None) -> SimResult:
        with self._oom_explained():
            return self._run(on_step)

    def _run(self, on_step: Callable[[StepReport], None] | None) -> SimResult:
        cfg = self.config
        start = time.perf_counter()
        val_curve = [(0, self.evaluate())]
        train_curve: list[tuple[int, float]] = []
        for step in range(1, cfg.steps + 1):
            train_loss = self.advance(step)
            tokens = step * cfg.tokens_per_step
            train_curve.append((tokens, train_loss))
            val_loss = None
            if step % cfg.eval_every_steps == 0 or step == cfg.steps:
                val_loss = self.evaluate()
                val_curve.append((tokens, val_loss))
            if on_step is not None:
                on_step(StepReport(step, tokens, train_loss, val_loss, time.perf_counter() - start))
        consensus = self._eval_path(self.consensus_stages())
        return SimResult(
            config=cfg, final_val_loss=val_curve[-1][1], final_consensus_val_loss=consensus,
            val_loss_curve=val_curve, train_loss_curve=train_curve,
            replica_weight_std=self.replica_weight_std(), tokens=cfg.steps * cfg.tokens_per_step,
            wall_s=time.perf_counter() - start, entropy_floor=self.data.entropy_floor,
            num_parameters=sum(p.numel() for sw in self.workers for p in sw[0].stage.parameters()),
            outer_rounds=self.outer_rounds)


def simulator_memory(config: SimConfig, model: ModelConfig) -> StageMemory:
    """The simulator's need on its one device: every worker's state, one micro-batch's
    activations through all stages at once (its autograd graph spans the whole path),
    and one stage's outer step for all its workers. It trains in fp32."""
    stages = [estimate_stage_memory(model, num_stages=config.stages, stage_index=s,
                                    batch_size=config.batch_size,
                                    seq_len=config.seq_len, autocast_bf16=False,
                                    outer_state=config.method.has_outer_step,
                                    layers_per_stage=config.layers_per_stage)
              for s in range(config.stages)]
    return StageMemory(parameters=config.replicas * sum(m.parameters for m in stages),
                       state_bytes=config.replicas * sum(m.state_bytes for m in stages),
                       activation_bytes=sum(m.activation_bytes for m in stages),
                       outer_step_bytes=config.replicas * max(m.outer_step_bytes for m in stages))

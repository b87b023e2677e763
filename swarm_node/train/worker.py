"""Everything torch does inside a node, in one object whose methods run on the node's
single compute thread (so they never race each other and never block the event loop).

Backward uses recomputation: a stage keeps only the *input* of each micro-batch in
flight and, when the gradient comes back, re-runs its forward with autograd and
backpropagates. A stashed autograd graph would be wrong here: the inner optimizer may
step between a micro-batch's forward and its backward, and the graph would then hold
the old weights (torch refuses it after in-place updates). Recomputation costs one
extra forward per stage, needs no graph memory, and gives the gradient at the current
weights, as the NoLoCo reference and SWARM do."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass

import torch

from swarm_node.model.stages import PipelineStage, build_stage
from swarm_node.optim.inner import InnerOptimizer, lr_at
from swarm_node.optim.outer import SlowWeights
from swarm_node.spec import RunSpec
from swarm_node.train.checkpoint_state import CheckpointState
from swarm_node.train.device import autocast, training_precision
from swarm_node.wire.boundary import BoundaryCodec
from swarm_node.wire.outer_codec import OuterEncoder, decode_outer, decode_outer_part, outer_codec
from swarm_node.wire.state_codec import tensor_digest


@dataclass(frozen=True)
class OpenRound:
    """What a round sends, taken at its boundary (ALGORITHM.md section 3.1)."""
    round_no: int
    wire: list[torch.Tensor]  # phi and Delta as the run's outer codec encodes them
    fraction: float  # of a round's inner steps it covers (below 1 when taken early)
    # overlapped: theta where the inner steps beside the exchange began (the local-only
    # outer step's result, ALGORITHM.md 3.1); None: blocking
    theta_start: list[torch.Tensor] | None
    delta_landed: bool = False  # a partner's Delta sent ahead of its phi has moved the steps
    steps: tuple[int, int] | None = None  # the inner steps its Delta covers: (the last boundary, this one)


def _training_work(method):
    """Counts the wall time of forward, backward and optimizer work: a node's compute
    utilisation is this over its wall time (what rounds and the network leave of it)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.training_s += time.perf_counter() - started
    return timed


class Pullback(torch.autograd.Function):
    """A scalar whose gradient wrt ``out`` is ``grad_output``, the same tensor: backward()
    of it is out.backward(grad_output) without the shape check that imports torch.fx's
    symbolic shapes and sympy (half a second and 300 modules in every node process but
    the last stage's), and without allocating anything the size of ``out``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        if out.shape != grad_output.shape:
            raise ValueError(f"a gradient of shape {tuple(grad_output.shape)} for an output of "
                             f"{tuple(out.shape)}")
        ctx.save_for_backward(grad_output)
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        (grad_output,) = ctx.saved_tensors
        return grad_output, None


class StageWorker(CheckpointState):
    def __init__(self, spec: RunSpec, stage_index: int, vocab_size: int, device: str = "cpu"):
        self.spec = spec
        self.device = torch.device(device)
        self.autocast_dtype = training_precision(self.device)  # None: fp32
        # a coded boundary (docs/ALGORITHM.md 9): the model the simulator builds for the run
        self.model_config, self.boundary = spec.model(vocab_size)
        # what the data path encodes with (train/hop_work.py): the run's codec name, or the coded boundary
        self.wire_codec: str | BoundaryCodec = self.boundary or spec.activation_codec
        self.stage: PipelineStage = build_stage(self.model_config, num_stages=spec.num_stages,
                                                stage_index=stage_index, seed=spec.seed,
                                                layers_per_stage=spec.layers_per_stage, device=self.device)
        self.params = list(self.stage.parameters())
        self.inner = InnerOptimizer(self.params, spec.inner)  # fused AdamW on CUDA (optim/inner.py)
        # --compile: seconds its blocks took to compile (train/compiled.py)
        self.compile_s: float | None = None
        self.slow = SlowWeights(self.params, spec.method.outer) if spec.method.has_outer_step else None
        self.codec = outer_codec(spec.outer_codec)
        self.encoder = OuterEncoder(self.codec) if self.slow else None
        self.open: OpenRound | None = None  # the round whose exchange is under way
        # its payload as partners decode it: needed for our scale, each check and the step
        self._own_decoded: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.outer_round = 0
        self.last_round_step = 0  # inner step at which the last outer round was applied
        self.round_forced = False  # a partner asked us to take this round early
        self.pending_samples = 0
        self.pending_microbatches = 0
        # --max-steps: no inner step past it, even for micro-batches a node still answers
        # while the stage before it finishes (train/pipeline.py)
        self.step_limit: int | None = None
        self.loss_ema: float | None = None
        self.training_s = 0.0  # wall time in forward, backward and inner steps
        self.last_step_at: float | None = None  # time.monotonic() of the last inner step

    # -- shapes a peer may send us ------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    def autocast(self):
        return autocast(self.device, self.autocast_dtype)

    # -- the data path ------------------------------------------------------------
    # With a coded boundary a stage after the first gets, beside the code, the window's
    # token ids (batch, seq + 1) where it would get the targets ("labels" below): it
    # reads its inputs' ids and the targets from them (wire/boundary.py window_ids).
    @_training_work
    @torch.no_grad()
    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        with self.autocast():
            return self.stage(inputs.to(self.device), tokens=self._tokens(labels)).float()

    def _tokens(self, labels: torch.Tensor | None) -> torch.Tensor | None:
        """The input ids a stage after a coded boundary needs, from the window's ids."""
        if self.boundary is None or self.is_first:
            return None
        return labels[:, :-1].to(self.device)

    @_training_work
    def forward_backward_last(self, hidden: torch.Tensor | None, targets: torch.Tensor,
                              token_inputs: torch.Tensor | None = None) -> tuple[float, torch.Tensor | None]:
        """Last stage: loss and its gradient in one pass. Returns (loss, grad wrt the
        stage input), the gradient being None for a single-stage model. ``targets``: the
        window's ids after a coded boundary."""
        x = self._stage_input(token_inputs if self.is_first else hidden)
        tokens = self._tokens(targets)
        if tokens is not None:
            targets = targets[:, 1:]
        with self.autocast():
            loss = self.stage(x, targets.to(self.device), tokens=tokens)
        loss.backward()
        self._accumulated(len(targets))
        value = float(loss.detach())
        self.loss_ema = value if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * value
        return value, None if self.is_first else x.grad.detach()

    @_training_work
    def backward(self, inputs: torch.Tensor, grad_output: torch.Tensor,
                 labels: torch.Tensor | None = None) -> torch.Tensor | None:
        """Recompute this stage's forward for ``inputs`` and backpropagate ``grad_output``."""
        x = self._stage_input(inputs)
        with self.autocast():
            out = self.stage(x, tokens=self._tokens(labels))
        Pullback.apply(out.float(), grad_output.to(self.device, torch.float32, non_blocking=True)).backward()
        self._accumulated(len(inputs))
        return None if self.is_first else x.grad.detach()

    def _stage_input(self, inputs: torch.Tensor) -> torch.Tensor:
        """Token ids for stage 0; otherwise float activations whose gradient we return."""
        if self.is_first:
            return inputs.to(self.device)
        # non_blocking: what the wire thread pinned (train/host_copy.py) is queued, not waited for
        return inputs.to(self.device, torch.float32, non_blocking=True).requires_grad_(True)

    def _accumulated(self, samples: int) -> None:
        self.pending_samples += samples
        self.pending_microbatches += 1

    # -- optimizer steps ---------------------------------------------------------
    def ready_to_step(self) -> bool:
        if self.step_limit is not None and self.inner_step >= self.step_limit:
            return False
        return self.pending_samples >= self.spec.samples_per_step

    @_training_work
    def step(self) -> int:
        """Average the accumulated gradients over micro-batches and take an inner step."""
        if self.pending_microbatches > 1:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                # one launch on CUDA, not one per tensor
                torch._foreach_div_(grads, self.pending_microbatches)
        self.inner.step()
        self.last_step_at = time.monotonic()
        self.pending_samples = 0
        self.pending_microbatches = 0
        return self.inner.step_count

    @property
    def inner_step(self) -> int:
        return self.inner.step_count

    def outer_round_due(self) -> bool:
        if self.slow is None:
            return False
        return self.round_forced or self.inner_step - self.last_round_step >= self.spec.method.inner_steps

    def round_fraction(self) -> float:
        """How much of a round's inner steps this round has taken (below 1 when taken early)."""
        return (self.inner_step - self.last_round_step) / self.spec.method.inner_steps

    def learning_rate(self, step: int) -> float:
        """The inner learning rate of ``step``, as every peer of the run has it."""
        return lr_at(step, self.spec.inner)

    @property
    def round_steps(self) -> int:
        return self.spec.method.inner_steps

    def can_round_early(self) -> bool:
        """Past half of this round: joining a partner's round now keeps the pair in
        phase, instead of both waiting out deadlines at alternating boundaries."""
        return (
            self.slow is not None
            and self.inner_step - self.last_round_step >= self.spec.method.inner_steps // 2
        )

    def force_round(self) -> None:
        self.round_forced = True

    # -- the outer step -------------------------------------------------------------
    @torch.no_grad()
    def open_round(self, overlapped: bool = False) -> OpenRound:
        """At a round boundary: encode what we send. Overlapped, theta is kept as it is
        now and inner steps go on while the exchange runs; the next round is due a
        round's steps from here."""
        fraction = self.round_fraction()
        wire = self.encoder.encode(self.slow.phi, self.slow.deltas())
        theta_start = self.slow.start_overlapped() if overlapped else None
        self.open = OpenRound(self.outer_round, wire, fraction, theta_start,
                              steps=(self.last_round_step, self.inner_step))
        self._own_decoded = None
        if overlapped:
            self.last_round_step = self.inner_step
            self.round_forced = False
        return self.open

    def own_payload(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(phi, Delta) of the open round as partners decode them, decoded once a round.
        Every member of a group uses the decoded values for the means, so partners agree
        bit for bit."""
        if self._own_decoded is None:
            self._own_decoded = self.decode_payload(self.open.wire, self.slow.phi[0].device)
        return self._own_decoded

    def decode_payload(self, wire: list[torch.Tensor],
                       device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A payload of the run's codec, ours or a partner's, read against our phi."""
        return decode_outer(wire, [p.shape for p in self.params], self.codec, device, near=self.slow.phi)

    def decode_part(self, tensors: list[torch.Tensor], part: str, device: torch.device) -> list[torch.Tensor]:
        """A partner's phi or Delta sent on its own (a Delta ahead of its phi)."""
        return decode_outer_part(tensors, [p.shape for p in self.params], self.codec, device, part,
                                 near=self.slow.phi)

    @torch.no_grad()
    def land_partner_delta(self, round_no: int, delta: list[torch.Tensor]) -> bool:
        """A partner's Delta, as checked, in ahead of its phi: the inner steps beside the
        exchange move onto the pair's Delta step now (ALGORITHM.md 3.1, Delta ahead of
        phi); ``close_round`` completes the step. Only for the open overlapped round it
        was sent for, once: returns whether it moved anything."""
        opened = self.open
        if opened is None or opened.round_no != round_no or opened.theta_start is None or opened.delta_landed:
            return False
        start = self.slow.land_deltas([self.own_payload()[1], delta], opened.theta_start)
        self.open = dataclasses.replace(opened, theta_start=start, delta_landed=True)
        return True

    @torch.no_grad()
    def close_round(self, others: list[tuple[list, list]]) -> None:
        """The outer step of the open round over our group: partners' (phi, Delta) as
        checked; none is the local-only step. The gamma pull acts on our exact phi
        (outer_update's first argument); the means widen one tensor at a time to
        float64, so no fp32 copy of the whole group is made."""
        opened = self.open
        members = [self.own_payload(), *others]
        self.encoder.observe(self.slow.phi, [phi for phi, _ in others])
        group_phi, group_delta = [phi for phi, _ in members], [delta for _, delta in members]
        if opened.theta_start is None:
            self.slow.apply(group_phi, group_delta)
            self.last_round_step = self.inner_step
            self.round_forced = False
        else:
            self.slow.apply_overlapped(group_phi, group_delta, opened.theta_start)
        self.encoder.commit()  # what this round could not send goes with the next
        self.outer_round += 1
        self.open, self._own_decoded = None, None

    def own_phi(self) -> list[torch.Tensor]:
        """Our outer weights as they are (partners' distance from them is screened)."""
        return self.slow.phi

    def own_delta(self) -> list[torch.Tensor]:
        """The Delta of the open round (as sent), else our progress since the last one."""
        return self.own_payload()[1] if self.open is not None else self.slow.deltas()

    # -- state transfer for late joiners --------------------------------------------
    @torch.no_grad()
    def snapshot(self) -> dict:
        """theta, phi and momentum that belong together, then the inner optimizer's
        moments (InnerOptimizer.moment_tensors): a copy with fresh moments makes Deltas
        several times its partners', which they refuse as poisoned.

        During an overlapped round theta goes on from our local outer step while phi is
        still the last round's, a pair whose Delta partners would refuse; so then the
        snapshot is the state the round's local-only close would leave (the progress
        since it opened kept), the round counted as done (docs/ARCHITECTURE.md, "Why it
        is this way")."""
        theta = [p.detach().float().cpu().clone() for p in self.params]
        phi = [t.cpu().clone() for t in self.slow.phi] if self.slow else []
        momentum = [t.cpu().clone() for t in self.slow.momentum] if self.slow else []
        outer_round = self.outer_round
        opened = self.open
        if self.slow and opened is not None and opened.theta_start is not None:
            theta, phi, momentum = ([t.float().cpu().clone() for t in ts]
                                    for ts in self.slow.local_close(*self.own_payload(), opened.theta_start))
            outer_round += 1
        tensors = theta + phi + momentum + self.inner.moment_tensors()
        return {"inner_step": self.inner_step, "outer_round": outer_round,
                "last_round_step": self.last_round_step, "tensors": tensors,
                "digest": tensor_digest(tensors)}

    def state_tensor_count(self) -> int:
        """Tensors in a snapshot: theta, phi and momentum (an outer step's), the moments."""
        n = len(self.params)
        return (3 if self.slow else 1) * n + 2 * n + 1

    def snapshot_problem(self, tensors: list[torch.Tensor]) -> str | None:
        """Why a snapshot's tensors (theta, then phi and momentum with an outer step,
        then the inner optimizer's moments) cannot be this stage's state, or None."""
        n = len(self.params)
        weights = (3 if self.slow else 1) * n
        if len(tensors) != self.state_tensor_count():
            return f"state has {len(tensors)} tensors, this stage needs {self.state_tensor_count()}"
        for i, t in enumerate(tensors[:weights]):
            shape = self.params[i % n].shape
            if t.shape != shape or not t.is_floating_point():
                return f"state tensor of shape {tuple(t.shape)} / {t.dtype} does not fit {tuple(shape)}"
            if not math.isfinite(float(t.float().sum())):
                return "state tensor with non-finite values"
        return self.inner.moments_problem(tensors[weights:])

    @torch.no_grad()
    def load_snapshot(self, inner_step: int, outer_round: int, tensors: list[torch.Tensor],
                      last_round_step: int | None = None) -> None:
        problem = self.snapshot_problem(tensors)
        if problem:
            raise ValueError(problem)
        n = len(self.params)
        for p, t in zip(self.params, tensors[:n]):
            p.copy_(t.to(p.device, p.dtype))
        if self.slow:
            self.slow.load_state_dict({"phi": [t.to(self.device) for t in tensors[n:2 * n]],
                                       "momentum": [t.to(self.device) for t in tensors[2 * n:3 * n]]})
        self.inner.load_moment_tensors(tensors[(3 if self.slow else 1) * n:])
        self.inner.step_count = inner_step
        self.outer_round = outer_round
        self.last_round_step = inner_step if last_round_step is None else min(last_round_step, inner_step)

    def theta_digest(self) -> str:
        return tensor_digest([p.detach().float().cpu() for p in self.params])


def throughput_ema(previous: float, samples: int, seconds: float, weight: float = 0.1) -> float:
    if seconds <= 0 or not math.isfinite(seconds):
        return previous
    rate = samples / seconds
    return rate if previous <= 0 else (1 - weight) * previous + weight * rate

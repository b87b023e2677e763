"""What the convergence benchmark runs: the plans (quick, full) and their jobs, in three
phases. Each phase's jobs depend on the one before: the inner lr is tuned once for DDP,
then the grids, the outer-lr sweep of the scaling rows and the NoLoCo sweep run with
it on the first seed, then the best outer lr per M and the best NoLoCo setting on the
other seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.convergence.stats import METHOD_ORDER
from swarm_node.optim.methods import PAPER_NOLOCO
from swarm_node.optim.outer import OuterHyper

NOLOCO_DEFAULT = "default"  # the sweep's label for the plan's NoLoCo settings (Plan.noloco_outer)


@dataclass(frozen=True)
class WireVariant:
    label: str
    outer_codec: str = "fp16"
    activation_codec: str = "fp16"
    latency_rounds: float | None = None  # an overlapped round's exchange lands this many rounds late


WIRE_BASELINE = "blocking fp16"
WIRE_VARIANTS = (WireVariant(WIRE_BASELINE), WireVariant("overlapped, half a round late", latency_rounds=0.5),
                 WireVariant("overlapped, one round late", latency_rounds=1.0),
                 WireVariant("overlapped, two rounds late", latency_rounds=2.0),
                 WireVariant("near4-3 payload", outer_codec="near4-3"),
                 WireVariant("overlapped, half a round late, near4-3 (the node's default)",
                             outer_codec="near4-3",
                             latency_rounds=0.5),
                 WireVariant("int8 activations", activation_codec="int8"))


@dataclass(frozen=True)
class Plan:
    model: str
    steps: int  # inner steps per worker, the same for every method
    global_batch: int  # sequences per step over all replicas; each of DP replicas gets global_batch / DP
    seq_len: int
    seeds: tuple[int, ...]
    grids: tuple[tuple[int, int], ...]  # (DP, PP)
    scaling_m: tuple[int, ...]  # DiLoCo replicas for the scaling-law ordering (PP = 1)
    eval_batches: int  # of 64 validation windows: 8 is the corpus' whole validation split
    inner_steps: tuple[tuple[str, int], ...] = ()  # H per method where not the project's default
    # The inner lr: each candidate trains DDP on the tuning grid (first seed) and the best
    # is used by every method; one candidate is no tuning at all.
    inner_lrs: tuple[float, ...] = ()  # empty: the model's suggested lr
    tune_grid: tuple[int, int] = (8, 1)
    # Scaling rows: DiLoCo with Nesterov momentum, the outer lr swept per M on the first
    # seed and the best one run on every seed (the scaling-law paper's procedure).
    scaling_momentum: float = 0.9
    scaling_outer_lrs: tuple[float, ...] = ()  # empty: ALGORITHM.md's outer lr by M, no sweep
    # NoLoCo's open settings, varied one at a time from the defaults on one grid.
    sweep_grid: tuple[int, int] = (4, 2)
    noloco_sweep: tuple[tuple[str, float], ...] = ()  # (alpha | beta | gamma, value)
    # How the node moves a round (issue 16), on one grid over every seed: the blocking 16-bit
    # round of before, the overlapped round landing late, the payload and activation codecs.
    wire_grid: tuple[int, int] = (4, 2)
    wire_variants: tuple[WireVariant, ...] = ()
    # The same again at the NoLoCo setting the sweep chose, where it is not the defaults:
    # the defaults are unstable in this regime (seeds 0.12 nats apart), which a variant's
    # small paired gap drowns in.
    wire_at_choice: tuple[WireVariant, ...] = ()
    # The data every run trains on (DataSpec.parse): the bundled corpus as bytes, or a
    # prepared subword dataset (manifest:FOLDER, bench/size_trend/data.py).
    data: str = "corpus"
    device: str = "cpu"
    curve_every: int = 50  # steps between the points of the validation-loss curve
    curve_batches: int = 2  # validation batches per point (the final evaluation takes eval_batches)
    # NoLoCo's outer settings where a job names none: the paper's, so a plan reproduces its
    # comparisons (and its ledger's rows) whatever the node's default becomes.
    noloco_outer: OuterHyper = PAPER_NOLOCO
    notes: tuple[str, ...] = field(default=())

    @property
    def scaling_reference(self) -> tuple[int, int]:
        """The DDP runs the scaling section compares with: the grid M_max x 1."""
        return (max(self.scaling_m), 1)

    def h_of(self, method: str) -> int | None:
        return dict(self.inner_steps).get(method)


# Quick: a smoke test of every phase, sized for `make bench` (about 4 minutes on 2 cores):
# 60 steps per run with H cut so the short run still has outer rounds.
QUICK = Plan(model="debug", steps=60, global_batch=32, seq_len=64, seeds=(0, 1),
             grids=((4, 2), (8, 2), (8, 1)), scaling_m=(1, 2, 4, 8), eval_batches=4,
             inner_steps=(("noloco", 6), ("diloco", 6)), inner_lrs=(2e-3, 4e-3),
             scaling_outer_lrs=(0.1, 0.2), noloco_sweep=(("gamma", 0.0),), curve_every=10,
             wire_variants=(WIRE_VARIANTS[0], WIRE_VARIANTS[5]))
# Full: a regime that can tell the methods apart (issue 17): a global batch of 64
# sequences (16 per replica at DP 4), 1000 steps at H = 10 for both methods (100 outer
# rounds), the inner lr tuned for DDP, about 90 CPU-minutes.
FULL = Plan(model="debug", steps=1000, global_batch=64, seq_len=64, seeds=(0, 1, 2),
            grids=((4, 2), (8, 2), (8, 1)), scaling_m=(1, 2, 4, 8), eval_batches=8,
            inner_steps=(("noloco", 10), ("diloco", 10)), inner_lrs=(1.5e-3, 3e-3, 6e-3),
            scaling_outer_lrs=(0.05, 0.1, 0.2, 0.4),
            noloco_sweep=(("gamma", 0.0), ("gamma", 0.35), ("gamma", 1.0), ("alpha", 0.3), ("alpha", 0.7),
                          ("beta", 0.5), ("beta", 1.0)),
            wire_variants=WIRE_VARIANTS, wire_at_choice=WIRE_VARIANTS[:3] + WIRE_VARIANTS[5:6])


@dataclass(frozen=True)
class Job:
    section: str  # "tune", "grid", "scaling" or "sweep"
    dp: int
    pp: int
    method: str
    seed: int
    plan: Plan
    inner_lr: float | None = None  # None: the model's suggested lr
    outer_lr: float | None = None  # None: the method's default, as for the others
    outer_momentum: float | None = None
    outer_gamma: float | None = None
    nesterov: bool = False
    variant: str = ""  # the sweep's or the wire section's label
    outer_codec: str = "fp32"
    activation_codec: str = "fp32"
    outer_latency_steps: int | None = None  # None: the blocking round
    overlap_start: str = "local"  # where an overlapped round's steps start (SimConfig.overlap_start)
    outer_landing: str = "whole"  # how its payloads land (SimConfig.outer_landing)
    group_size: int = 2  # NoLoCo's group (2: pairs)
    freeze_embedding: bool = False  # the reference code's frozen input embedding (ablation)

    @property
    def cost(self) -> int:
        """Relative cost, to start the longest runs first: micro-batch passes per step."""
        return self.dp * self.pp


def _longest_first(jobs: list[Job]) -> list[Job]:
    return sorted(jobs, key=lambda j: -j.cost)


def tuning_jobs(plan: Plan) -> list[Job]:
    dp, pp = plan.tune_grid
    if len(plan.inner_lrs) < 2:
        return []
    return [Job("tune", dp, pp, "ddp", plan.seeds[0], plan, inner_lr=lr) for lr in plan.inner_lrs]


def _scaling_lrs(plan: Plan, m: int) -> tuple[float, ...]:
    from bench.convergence.stats import SCALING_OUTER_LR

    return plan.scaling_outer_lrs or (SCALING_OUTER_LR[m],)


def noloco_override(setting: str, value: float) -> dict[str, float]:
    """The Job field a sweep label ("alpha = 0.3") sets."""
    overrides = {"alpha": "outer_momentum", "beta": "outer_lr", "gamma": "outer_gamma"}
    if setting not in overrides:
        raise ValueError(f"the NoLoCo sweep varies alpha, beta or gamma, not {setting!r}")
    return {overrides[setting]: value}


def _sweep_job(plan: Plan, seed: int, inner_lr: float | None, setting: str, value: float) -> Job:
    dp, pp = plan.sweep_grid
    return Job("sweep", dp, pp, "noloco", seed, plan, inner_lr=inner_lr, variant=f"{setting} = {value}",
               **noloco_override(setting, value))


def wire_label(variant: str, choice: str = NOLOCO_DEFAULT) -> str:
    """A wire variant's label; at a NoLoCo setting other than the defaults it names it."""
    return variant if choice == NOLOCO_DEFAULT else f"{variant}; {choice}"


def wire_jobs(plan: Plan, inner_lr: float | None, choice: str = NOLOCO_DEFAULT) -> list[Job]:
    """Every wire variant on the wire grid and every seed: NoLoCo with the defaults, or
    the plan's ``wire_at_choice`` variants at the sweep's ``choice`` ("alpha = 0.3")."""
    dp, pp = plan.wire_grid
    h = plan.h_of("noloco")
    variants, override = plan.wire_variants, {}
    if choice != NOLOCO_DEFAULT:
        setting, value = choice.split(" = ")
        variants, override = plan.wire_at_choice, noloco_override(setting, float(value))
    if variants and h is None:
        raise ValueError("the wire section needs NoLoCo's H in the plan")
    return [Job("wire", dp, pp, "noloco", seed, plan, inner_lr=inner_lr, variant=wire_label(v.label, choice),
                outer_codec=v.outer_codec, activation_codec=v.activation_codec,
                outer_latency_steps=None if v.latency_rounds is None else round(v.latency_rounds * h),
                **override)
            for v in variants for seed in plan.seeds]


def main_jobs(plan: Plan, inner_lr: float | None) -> list[Job]:
    """Every grid on every seed; the scaling and NoLoCo sweeps on the first seed."""
    if plan.scaling_reference not in plan.grids:
        raise ValueError(f"the scaling section needs the DDP runs of grid {plan.scaling_reference}")
    if plan.sweep_grid not in plan.grids:
        raise ValueError(f"the NoLoCo sweep needs the runs of grid {plan.sweep_grid}")
    first = plan.seeds[0]
    jobs = [Job("grid", dp, pp, method, seed, plan, inner_lr=inner_lr)
            for dp, pp in plan.grids for method in METHOD_ORDER for seed in plan.seeds]
    jobs += [Job("scaling", m, 1, "diloco", first, plan, inner_lr=inner_lr, outer_lr=lr,
                 outer_momentum=plan.scaling_momentum, nesterov=True)
             for m in plan.scaling_m for lr in _scaling_lrs(plan, m)]
    jobs += [_sweep_job(plan, first, inner_lr, setting, value) for setting, value in plan.noloco_sweep]
    jobs += wire_jobs(plan, inner_lr)
    return _longest_first(jobs)


def confirming_jobs(plan: Plan, inner_lr: float | None, best_scaling_lr: dict[int, float],
                    best_sweep: str) -> list[Job]:
    """The chosen outer lr per M, and the chosen NoLoCo setting (unless the defaults won,
    which the grids ran on every seed already), on the seeds after the first."""
    rest = plan.seeds[1:]
    jobs = [Job("scaling", m, 1, "diloco", seed, plan, inner_lr=inner_lr, outer_lr=lr,
                outer_momentum=plan.scaling_momentum, nesterov=True)
            for m, lr in best_scaling_lr.items() for seed in rest]
    if best_sweep != NOLOCO_DEFAULT:
        setting, value = best_sweep.split(" = ")
        jobs += [_sweep_job(plan, seed, inner_lr, setting, float(value)) for seed in rest]
        jobs += wire_jobs(plan, inner_lr, best_sweep)
    return _longest_first(jobs)

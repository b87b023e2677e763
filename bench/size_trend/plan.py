"""What the size-trend benchmark runs. Per model size: the inner lr tuned for DDP on the
4 x 2 grid (first seed; a best lr on the grid's edge is followed one halving or doubling
further, twice at most) and used by every method; DDP, local-only, NoLoCo at H, DiLoCo
at H (equal H) and at 2H (the paper's ratio: NoLoCo 50, DiLoCo 100) on every seed,
and NoLoCo with outer momentum 0.3 (the candidate default from the byte-level sweep);
DiLoCo with one replica (M = 1) against DDP on one worker (the same batch and the same
data order, so the pair differs only in the outer step), its outer lr swept
(Nesterov 0.9) on the first seed (0.1-1.0 at the smallest size, 0.1-0.4 at the larger,
followed past an edge) and the best run on every seed. At the smallest and
the largest size, ablations on the first seed: the reference code's frozen input
embedding, NoLoCo in groups of 3 and 4, NoLoCo's alpha, beta and gamma one at a time,
and half the tuned inner lr for the methods whose workers step alone. The largest
size's seeds after the first run last (``deferred``).

The sizes on a CPU: debug, mini and tiny, 0.11M, 0.85M and 3.4M parameters outside the
embeddings (32x from first to last; with a 4k vocabulary the embedding and head are most
of the smaller ones' parameters); `small` (85M) joins on a CUDA card."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.convergence.plan import Job, Plan
from swarm_node.config import suggested_lr

GRID = (4, 2)
M1_H = 20  # DiLoCo's H in the M = 1 rows (the scaling-law paper's runs sync every few dozen steps)
# where NoLoCo's steady gain beta / (1 - alpha) is 1: the node's default (docs/ALGORITHM.md 3.4)
LOW_ALPHA = 0.3


@dataclass(frozen=True)
class SizePlan:
    sizes: tuple[str, ...]
    steps: int
    seeds: tuple[int, ...]
    h: int  # NoLoCo's H; DiLoCo runs at H and at 2H
    lr_factors: tuple[float, ...]  # inner lr candidates: the size's suggested lr times these
    m1_outer_lrs: tuple[float, ...]  # the smallest size's sweep
    # The larger sizes' sweep: around the smallest's best, followed past its edge if the
    # best lies on one (as the inner lr is).
    m1_outer_lrs_larger: tuple[float, ...]
    # (label, field, value): first seed, smallest and largest size
    ablations: tuple[tuple[str, str, object], ...]
    corpus: str  # "bundled" or "docs" (data.py)
    global_batch: int = 64
    seq_len: int = 64
    eval_batches: int = 8
    curve_every: int = 50
    device: str = "cpu"

    def base(self, size: str, data: str) -> Plan:
        return Plan(model=size, steps=self.steps, global_batch=self.global_batch, seq_len=self.seq_len,
                    seeds=self.seeds, grids=(GRID,), scaling_m=(1,), eval_batches=self.eval_batches,
                    inner_steps=(("noloco", self.h), ("diloco", self.h)), data=data, device=self.device,
                    curve_every=min(self.curve_every, self.steps))


# NoLoCo's own settings first (what the issue asks at the largest size, where a tiny run
# costs 40 CPU-minutes), then what could explain a gap in any method. The last: DDP's
# tuned lr is DDP's best at 4x the batch of a worker's local step, so the
# low-communication methods are also run at half of it, to see whether the gaps follow
# the lr rather than the method.
OUTER_ABLATIONS = (("alpha 0.7", "outer_momentum", 0.7), ("beta 0.5", "outer_lr", 0.5),
                   ("beta 1.0", "outer_lr", 1.0), ("gamma 0.35", "outer_gamma", 0.35),
                   ("gamma 1.0", "outer_gamma", 1.0))
GAP_ABLATIONS = (("frozen input embedding", "freeze_embedding", True), ("groups of 3", "group_size", 3),
                 ("groups of 4", "group_size", 4))
ABLATIONS = (*OUTER_ABLATIONS, *GAP_ABLATIONS, ("inner lr halved", "inner_lr_factor", 0.5))
ABLATION_METHODS = {"inner_lr_factor": ("local", "diloco", "noloco"),
                    "freeze_embedding": ("ddp", "diloco", "noloco")}
QUICK = SizePlan(sizes=("debug", "tiny"), steps=24, seeds=(0,), h=4, lr_factors=(1.0,), m1_outer_lrs=(0.7,),
                 m1_outer_lrs_larger=(0.7,),
                 ablations=GAP_ABLATIONS[:2], corpus="bundled", curve_every=12, eval_batches=2)
# M = 1's outer lrs: with Nesterov 0.9 a steady Delta moves phi about lr / (1 - 0.9) times
# over, so 0.1 is the plain inner optimizer's pace; debug's best of 0.2-1.0 was 0.2, the
# edge, and of 0.1-1.0 0.2 (0.7 and 1.0 two and five times 0.4's gap to DDP): the larger
# sizes sweep 0.1-0.4.
FULL = SizePlan(sizes=("debug", "mini", "tiny"), steps=1000, seeds=(0, 1, 2), h=10,
                lr_factors=(0.5, 1.0, 2.0), m1_outer_lrs=(0.1, 0.2, 0.4, 0.7, 1.0),
                m1_outer_lrs_larger=(0.1, 0.2, 0.4), ablations=ABLATIONS, corpus="docs")


def with_gpu(plan: SizePlan) -> SizePlan:
    """On a CUDA card the `small` model joins the trend (25x tiny's parameters outside the embeddings)."""
    return replace(plan, sizes=(*plan.sizes, "small"), device="cuda")


def tuning_jobs(plan: SizePlan, size: str, data: str) -> list[Job]:
    base = plan.base(size, data)
    return [Job("tune", *GRID, "ddp", plan.seeds[0], base,
                inner_lr=suggested_lr(size) * f) for f in plan.lr_factors]


def method_jobs(plan: SizePlan, size: str, data: str, inner_lr: float) -> list[Job]:
    """Every method on every seed, and the M = 1 outer-lr sweep on the first seed."""
    base = plan.base(size, data)
    ratio = replace(base, inner_steps=(("noloco", plan.h), ("diloco", 2 * plan.h)))
    m1 = _m1_plan(plan, size, data)
    jobs = []
    for seed in plan.seeds:
        jobs += [Job("size", *GRID, "ddp", seed, base, inner_lr=inner_lr),
                 Job("size", *GRID, "local", seed, base, inner_lr=inner_lr),
                 Job("size", *GRID, "noloco", seed, base, inner_lr=inner_lr, variant=f"H={plan.h}"),
                 Job("size", *GRID, "noloco", seed, base, inner_lr=inner_lr, outer_momentum=LOW_ALPHA,
                     variant=f"H={plan.h} alpha {LOW_ALPHA:g}"),
                 Job("size", *GRID, "diloco", seed, base, inner_lr=inner_lr, variant=f"H={plan.h}"),
                 Job("size", *GRID, "diloco", seed, ratio, inner_lr=inner_lr, variant=f"H={2 * plan.h}"),
                 Job("m1", 1, 1, "ddp", seed, m1, inner_lr=inner_lr)]
    lrs = plan.m1_outer_lrs if size == plan.sizes[0] else plan.m1_outer_lrs_larger
    return jobs + [m1_job(plan, size, data, inner_lr, lr) for lr in lrs]


def m1_job(plan: SizePlan, size: str, data: str, inner_lr: float, outer_lr: float,
           seed: int | None = None) -> Job:
    """DiLoCo with one replica at ``outer_lr`` (Nesterov 0.9), the first seed unless told."""
    return Job("m1", 1, 1, "diloco", plan.seeds[0] if seed is None else seed, _m1_plan(plan, size, data),
               inner_lr=inner_lr, outer_lr=outer_lr, outer_momentum=0.9, nesterov=True,
               variant=f"outer lr {outer_lr:g}")


def _m1_plan(plan: SizePlan, size: str, data: str) -> Plan:
    return replace(plan.base(size, data), inner_steps=(("diloco", M1_H),))


def seed_major(plan: SizePlan, jobs: list[Job]) -> list[Job]:
    """Every size's first seed before any size's second, the M = 1 outer-lr sweeps after
    the last seed (a stable sort: sizes stay smallest first), so a plan stopped part-way
    has the trend's first points at every size."""
    def rank(job: Job) -> int:
        sweep = job.section == "m1" and job.method == "diloco"
        return len(plan.seeds) if sweep else plan.seeds.index(job.seed)

    return sorted(jobs, key=rank)


def deferred(plan: SizePlan, job: Job) -> bool:
    """Whether ``job`` waits until after the ablations: the largest size's seeds after the
    first (with its M = 1 confirmations). A tiny run is 40 CPU-minutes, and its seeds 1-2
    are 16 runs, 11 CPU-hours; the two smaller sizes' three seeds give the spread first,
    and the largest size's own spread comes last."""
    return len(plan.sizes) > 1 and job.plan.model == plan.sizes[-1] and job.seed != plan.seeds[0]


def m1_confirming_jobs(plan: SizePlan, size: str, data: str, inner_lr: float, outer_lr: float) -> list[Job]:
    return [m1_job(plan, size, data, inner_lr, outer_lr, seed) for seed in plan.seeds[1:]]


def ablation_jobs(plan: SizePlan, size: str, data: str, inner_lr: float) -> list[Job]:
    """At ``size`` on the first seed: NoLoCo's settings for NoLoCo; the frozen embedding for
    every method that trains it; the halved inner lr for every method stepping alone."""
    base = plan.base(size, data)
    seed, jobs = plan.seeds[0], []
    for label, field, value in plan.ablations:
        for method in ABLATION_METHODS.get(field, ("noloco",)):
            job = Job("ablation", *GRID, method, seed, base, inner_lr=inner_lr, variant=label)
            if field == "inner_lr_factor":
                jobs.append(replace(job, inner_lr=inner_lr * value))
            else:
                jobs.append(replace(job, **{field: value}))
    return jobs

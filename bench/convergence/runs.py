"""One simulator run per job, in worker processes of one torch thread each (tiny models
do not gain from intra-op threads; two processes use two cores fully)."""

from __future__ import annotations

import hashlib
import multiprocessing
import pickle
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench.common.procs import unwind_on_sigterm
from bench.convergence.plan import Job
from bench.convergence.stats import perplexity
from swarm_node.optim.methods import default_method

EVAL_PATHS_SEED = 0  # every run is evaluated on the same random paths
RESUME_EVERY_S = 600.0  # a resumable run saves itself this often: a tiny-model run is 450 MB, about 3 s


def sim_config(job: Job):
    from swarm_node.config import default_warmup_steps, suggested_lr
    from swarm_node.data.spec import DataSpec
    from swarm_node.optim import InnerHyper
    from swarm_node.sim.config import SimConfig

    plan = job.plan
    if plan.global_batch % job.dp:
        raise ValueError(f"global batch {plan.global_batch} does not split over {job.dp} replicas")
    inner = InnerHyper(lr=job.inner_lr or suggested_lr(plan.model),
                       warmup_steps=default_warmup_steps(plan.steps),
                       total_steps=plan.steps)
    return SimConfig(method=job_method(job), inner=inner, data=DataSpec.parse(plan.data), device=plan.device,
                     freeze_input_embedding=job.freeze_embedding,
                     replicas=job.dp, stages=job.pp, model_size=plan.model, seq_len=plan.seq_len,
                     batch_size=plan.global_batch // job.dp, steps=plan.steps, seed=job.seed,
                     eval_batches=plan.eval_batches, eval_batch_size=64, outer_codec=job.outer_codec,
                     activation_codec=job.activation_codec, outer_latency_steps=job.outer_latency_steps,
                     overlap_start=job.overlap_start, outer_landing=job.outer_landing)


def job_method(job: Job):
    """The method ``job`` trains with: its own outer settings, else its plan's NoLoCo
    settings (Plan.noloco_outer), else the method's defaults."""
    base = job.plan.noloco_outer if job.method == "noloco" else None

    def pick(asked: float | None, field: str) -> float | None:
        return asked if asked is not None or base is None else getattr(base, field)

    return default_method(job.method, inner_steps=job.plan.h_of(job.method), beta=pick(job.outer_lr, "beta"),
                          alpha=pick(job.outer_momentum, "alpha"), gamma=pick(job.outer_gamma, "gamma"),
                          nesterov=job.nesterov, group_size=job.group_size)


def _train(sim, every: int, curve_batches: int, curve: list, start: int, on_step=lambda step: None) -> list:
    """Simulator.run's step loop without its step-0 evaluation (it costs as much as the
    final one and is not reported), from step ``start``; returns the loss curve: every
    ``every`` steps the validation loss over random paths on the first ``curve_batches``
    batches (what the swarm's model can do at that point; a replica's own training loss
    flatters methods whose replicas drift apart)."""
    for step in range(start, sim.config.steps + 1):
        sim.advance(step)
        if step % every == 0:
            curve.append([step, round(sim.evaluate_random_paths(EVAL_PATHS_SEED, max_batches=curve_batches),
                                      5)])
        on_step(step)
    return curve


class Resumable:
    """A run that outlives its process: every RESUME_EVERY_S seconds the whole simulator
    (every worker's weights, optimizer states, outer state, data position and random
    generators: a pickle of it continues bit for bit, tests/unit/test_resumable_runs.py)
    goes to ``folder``, named by the job, and a later run of the same job goes on from it.
    For plans of many CPU-hours stopped and started again: a tiny-model run is 40
    CPU-minutes, lost whole without this."""

    def __init__(self, folder: Path, job: Job):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{hashlib.sha256(repr(job).encode()).hexdigest()[:24]}.pkl"
        self._saved_at = time.monotonic()

    def load(self) -> dict | None:
        if not self.path.is_file():
            return None
        with open(self.path, "rb") as f:
            return pickle.load(f)

    def save_now_and_then(self, state: dict) -> None:
        from swarm_node.system import write_atomic

        if time.monotonic() - self._saved_at >= RESUME_EVERY_S:
            write_atomic(self.path, lambda f: pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL))
            self._saved_at = time.monotonic()

    def done(self) -> None:
        self.path.unlink(missing_ok=True)


class ResumedRun:
    """A simulator run begun afresh or taken up from where an earlier process left it
    (Resumable, with ``resume_dir``), its CPU and wall seconds counted across processes."""

    def __init__(self, make_sim: Callable[[], object], job, resume_dir: Path | None):
        self._cpu_started, self._wall_started = time.process_time(), time.perf_counter()
        self._resumable = Resumable(resume_dir, job) if resume_dir is not None else None
        state = self._resumable.load() if self._resumable is not None else None
        if state is None:
            state = {"sim": make_sim(), "curve": [], "next_step": 1, "cpu_s": 0.0, "wall_s": 0.0}
        self.state = state

    def seconds(self) -> dict:
        """This run's wall and CPU seconds so far, earlier processes' included."""
        return {"wall_s": self.state["wall_s"] + time.perf_counter() - self._wall_started,
                "cpu_s": self.state["cpu_s"] + time.process_time() - self._cpu_started}

    def on_step(self, step: int) -> None:
        if self._resumable is not None:
            self._resumable.save_now_and_then(self.state | {"next_step": step + 1, **self.seconds()})

    def done(self) -> None:
        if self._resumable is not None:
            self._resumable.done()


def run_job(job: Job, resume_dir: Path | None = None) -> dict:
    """One simulator run (in a worker process); returns the flat per-seed row. Its
    ``val_loss`` is over random paths, as a swarm routes (the same draws for every run);
    ``fixed_val_loss`` over the paths "worker r at every stage", which fixed routing
    trains; ``consensus_val_loss`` of one model of each stage's mean weights. With
    ``resume_dir``, the run goes on from where an earlier process left it (Resumable)."""
    from swarm_node.sim.simulator import Simulator
    from swarm_node.train.evaluate import path_val_loss

    config = sim_config(job)
    run = ResumedRun(lambda: Simulator(config), job, resume_dir)
    state, sim = run.state, run.state["sim"]

    curve = _train(sim, job.plan.curve_every, job.plan.curve_batches, state["curve"], state["next_step"],
                   run.on_step)
    val_loss = sim.evaluate_random_paths(EVAL_PATHS_SEED)
    fixed_val_loss = sim.evaluate()
    consensus_loss = path_val_loss(sim.consensus_stages(), sim.data, batch_size=config.eval_batch_size,
                                   max_batches=config.eval_batches)
    method = config.method
    row = {"kind": "run", "section": job.section, "dp": job.dp, "pp": job.pp, "method": job.method,
           "seed": job.seed, "variant": job.variant, "batch_size": config.batch_size,
           "outer_codec": job.outer_codec, "activation_codec": job.activation_codec,
           "outer_latency_steps": job.outer_latency_steps, "overlap_start": job.overlap_start,
           "outer_landing": job.outer_landing, "model": job.plan.model, "group_size": job.group_size,
           "freeze_embedding": job.freeze_embedding, "outer_lr_asked": job.outer_lr, "steps": job.plan.steps,
           "inner_lr": config.inner.lr, "inner_steps": method.inner_steps,
           "outer_lr": method.outer.beta if method.outer else None,
           "outer_momentum": method.outer.alpha if method.outer else None,
           "outer_gamma": method.outer.gamma if method.outer else None,
           "nesterov": method.outer.nesterov if method.outer else None,
           "val_loss": val_loss, "ppl": perplexity(val_loss), "fixed_val_loss": fixed_val_loss,
           "consensus_val_loss": consensus_loss, "weight_std": max(sim.replica_weight_std()),
           "outer_rounds": sim.outer_rounds, "tokens": config.steps * config.tokens_per_step,
           "loss_curve": curve,
           "num_parameters": sum(p.numel() for stage in sim.workers for p in stage[0].stage.parameters()),
           "val_windows": min(config.eval_batches * config.eval_batch_size, sim.data.num_val_windows),
           "all_val_windows": sim.data.num_val_windows, **run.seconds()}
    run.done()
    return row


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


class Runner:
    """A pool of ``workers`` processes for every phase; leaving the ``with`` block
    terminates them on any error, Ctrl-C or SIGTERM."""

    def __init__(self, workers: int, resume_dir: Path | None = None):
        self.workers = workers
        self.resume_dir = resume_dir  # runs a stopped process left part-way go on from there (Resumable)
        self.done = 0

    def __enter__(self) -> Runner:
        unwind_on_sigterm()  # through the pool's exit, which terminates the workers
        self._pool = multiprocessing.get_context("spawn").Pool(self.workers, initializer=_one_thread)
        self._pool.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._pool.__exit__(*exc)

    def run(self, jobs: list[Job], phase: str, on_row=lambda row: None) -> list[dict]:
        """Every job's row; ``on_row`` sees each as it finishes (a ledger writes it down)."""
        rows = []
        for n, row in enumerate(self._pool.imap_unordered(partial(run_job, resume_dir=self.resume_dir), jobs),
                                1):
            rows.append(row)
            on_row(row)
            label = f" {row['variant']}" if row["variant"] else ""
            lrs = f" inner lr {row['inner_lr']:g}" if row["section"] == "tune" else ""
            outer = f" outer lr {row['outer_lr']:g}" if row["section"] == "scaling" else ""
            print(
                f"{phase} [{n}/{len(jobs)}] {row['section']} {row['dp']} x {row['pp']} {row['method']}{label}"
                f"{lrs}{outer} seed {row['seed']}: ppl {row['ppl']:.3f} ({row['wall_s']:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
        return sorted(rows, key=lambda r: (r["section"], r["pp"], r["dp"], r["method"], r["variant"],
                                           r["outer_lr"] or 0.0, r["seed"]))

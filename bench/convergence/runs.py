"""One simulator run per job, in worker processes of one torch thread each (tiny models
do not gain from intra-op threads; two processes use two cores fully)."""

from __future__ import annotations

import multiprocessing
import sys
import time

from bench.common.procs import unwind_on_sigterm
from bench.convergence.plan import Job
from bench.convergence.stats import perplexity
from swarm_node.optim.methods import default_method

EVAL_PATHS_SEED = 0  # every run is evaluated on the same random paths


def sim_config(job: Job):
    from swarm_node.config import default_warmup_steps, suggested_lr
    from swarm_node.data.spec import DataSpec
    from swarm_node.optim import InnerHyper
    from swarm_node.sim.config import SimConfig

    plan = job.plan
    if plan.global_batch % job.dp:
        raise ValueError(f"global batch {plan.global_batch} does not split over {job.dp} replicas")
    inner = InnerHyper(lr=job.inner_lr or suggested_lr(plan.model), warmup_steps=default_warmup_steps(plan.steps),
                       total_steps=plan.steps)
    method = default_method(job.method, inner_steps=plan.h_of(job.method), beta=job.outer_lr,
                            alpha=job.outer_momentum, gamma=job.outer_gamma, nesterov=job.nesterov,
                            group_size=job.group_size)
    return SimConfig(method=method, inner=inner, data=DataSpec.parse(plan.data), device=plan.device,
                     freeze_input_embedding=job.freeze_embedding,
                     replicas=job.dp, stages=job.pp, model_size=plan.model, seq_len=plan.seq_len,
                     batch_size=plan.global_batch // job.dp, steps=plan.steps, seed=job.seed,
                     eval_batches=plan.eval_batches, eval_batch_size=64, outer_codec=job.outer_codec,
                     activation_codec=job.activation_codec, outer_latency_steps=job.outer_latency_steps,
                     overlap_start=job.overlap_start, outer_landing=job.outer_landing)


def _train(sim, every: int, curve_batches: int) -> list[list[float]]:
    """Simulator.run's step loop without its step-0 evaluation (it costs as much as the
    final one and is not reported); returns the loss curve: every ``every`` steps the
    validation loss over random paths on the first ``curve_batches`` batches (what the
    swarm's model can do at that point; a replica's own training loss flatters methods
    whose replicas drift apart)."""
    curve = []
    for step in range(1, sim.config.steps + 1):
        sim.advance(step)
        if step % every == 0:
            curve.append([step, round(sim.evaluate_random_paths(EVAL_PATHS_SEED, max_batches=curve_batches), 5)])
    return curve


def run_job(job: Job) -> dict:
    """One simulator run (in a worker process); returns the flat per-seed row. Its
    ``val_loss`` is over random paths, as a swarm routes (the same draws for every run);
    ``fixed_val_loss`` over the paths "worker r at every stage", which fixed routing
    trains; ``consensus_val_loss`` of one model of each stage's mean weights."""
    from swarm_node.sim.simulator import Simulator
    from swarm_node.train.evaluate import path_val_loss

    config = sim_config(job)
    cpu_started, wall_started = time.process_time(), time.perf_counter()
    sim = Simulator(config)
    curve = _train(sim, job.plan.curve_every, job.plan.curve_batches)
    val_loss = sim.evaluate_random_paths(EVAL_PATHS_SEED)
    fixed_val_loss = sim.evaluate()
    consensus_loss = path_val_loss(sim.consensus_stages(), sim.data, batch_size=config.eval_batch_size,
                                   max_batches=config.eval_batches)
    method = config.method
    return {"kind": "run", "section": job.section, "dp": job.dp, "pp": job.pp, "method": job.method,
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
            "all_val_windows": sim.data.num_val_windows,
            "wall_s": time.perf_counter() - wall_started, "cpu_s": time.process_time() - cpu_started}


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


class Runner:
    """A pool of ``workers`` processes for every phase; leaving the ``with`` block
    terminates them on any error, Ctrl-C or SIGTERM."""

    def __init__(self, workers: int):
        self.workers = workers
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
        for n, row in enumerate(self._pool.imap_unordered(run_job, jobs), 1):
            rows.append(row)
            on_row(row)
            label = f" {row['variant']}" if row["variant"] else ""
            lrs = f" inner lr {row['inner_lr']:g}" if row["section"] == "tune" else ""
            outer = f" outer lr {row['outer_lr']:g}" if row["section"] == "scaling" else ""
            print(f"{phase} [{n}/{len(jobs)}] {row['section']} {row['dp']} x {row['pp']} {row['method']}{label}"
                  f"{lrs}{outer} seed {row['seed']}: ppl {row['ppl']:.3f} ({row['wall_s']:.1f} s)",
                  file=sys.stderr, flush=True)
        return sorted(rows, key=lambda r: (r["section"], r["pp"], r["dp"], r["method"], r["variant"],
                                           r["outer_lr"] or 0.0, r["seed"]))

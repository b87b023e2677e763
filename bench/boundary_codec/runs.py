"""One simulator run per job of the boundary-codec plan (plan.py), in worker processes
of one torch thread each, resumable as the size trend's are (bench/convergence/runs.py)."""

from __future__ import annotations

from pathlib import Path

from bench.boundary_codec.plan import CodecJob
from bench.convergence.runs import EVAL_PATHS_SEED, ResumedRun, _train
from bench.convergence.stats import perplexity


def sim_config(job: CodecJob):
    from swarm_node.config import default_warmup_steps
    from swarm_node.data.spec import DataSpec
    from swarm_node.optim import InnerHyper
    from swarm_node.optim.methods import default_method
    from swarm_node.sim.config import SimConfig

    inner = InnerHyper(lr=job.inner_lr, warmup_steps=default_warmup_steps(job.steps), total_steps=job.steps)
    return SimConfig(method=default_method("noloco", inner_steps=job.h), inner=inner,
                     data=DataSpec.parse(job.data),
                     replicas=job.dp, stages=job.pp, model_size=job.model, num_layers=job.layers,
                     seq_len=job.seq_len, batch_size=job.global_batch // job.dp, steps=job.steps,
                     seed=job.seed,
                     eval_batches=job.eval_batches, eval_batch_size=64, activation_codec=job.codec,
                     activation_ratio=job.ratio, outer_codec="near4-3", device=job.device)


def run_job(job: CodecJob, resume_dir: Path | None = None) -> dict:
    """One run; the flat row the ledger keeps. ``val_loss``: over random paths, as the
    size trend reports it; the wire's bytes a token, as the node would send them."""
    from swarm_node.sim.simulator import Simulator
    from swarm_node.wire.boundary import bytes_per_token

    config = sim_config(job)
    run = ResumedRun(lambda: Simulator(config), job, resume_dir)
    state, sim = run.state, run.state["sim"]

    curve = _train(sim, job.curve_every, job.curve_batches, state["curve"], state["next_step"], run.on_step)
    val_loss = sim.evaluate_random_paths(EVAL_PATHS_SEED)
    hidden = sim.model_config.hidden_size
    if sim.boundary is not None:
        forward_b, backward_b = bytes_per_token(sim.boundary, config.batch_size, config.seq_len)
        width, bits = sim.boundary.width, sim.boundary.bits
    else:  # fp16 or int8 activations and int32 targets, as the node sends them today
        per_value = {"fp16": 2.0, "int8": 1 + 4 / 256, "fp32": 4.0}[job.codec]
        forward_b, backward_b = per_value * hidden + 4, per_value * hidden
        width, bits = hidden, {"fp16": 16, "int8": 8, "fp32": 32}[job.codec]
    row = {"kind": "run", "label": job.label, **job.key_fields(), "hidden": hidden, "width": width,
           "bits": bits,
           "forward_bytes_per_token": forward_b, "backward_bytes_per_token": backward_b,
           "ratio_achieved": 2 * hidden / forward_b, "val_loss": val_loss, "ppl": perplexity(val_loss),
           "loss_curve": curve, "tokens": config.steps * config.tokens_per_step,
           "num_parameters": sum(p.numel() for stage in sim.workers for p in stage[0].stage.parameters()),
           "weight_std": max(sim.replica_weight_std()), **run.seconds()}
    run.done()
    return row

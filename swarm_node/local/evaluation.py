"""The final evaluation of ``swarm-node local``: which model paths it evaluates and which
it skips (and why), on the run's own device in parts of a batch that fit, and how an
interrupted run stops it.

The paths are the initial weights, each replica r (node r of every stage) and the
consensus model (each stage the mean of its nodes). A path that needs the weights of a
node that died is skipped, as is the consensus model of a run with a dead node; a stage
whose nodes all died leaves nothing to evaluate, so nothing is (not even the initial
weights: a model that did not fit its device is not evaluated on the CPU instead). Nodes
the chaos plan killed on purpose are left out of the consensus and stop nothing.

The modules of one path at a time live on the device; a path's weights are loaded from
the CPU copies the nodes wrote. Between validation batches the evaluation checks its
stop event, so Ctrl-C or SIGTERM ends it within a batch."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from swarm_node.data.dataset import TokenWindows
from swarm_node.model.config import ModelConfig
from swarm_node.model.stages import PipelineStage, build_stage
from swarm_node.obs.progress import EvaluationProgress
from swarm_node.spec import RunSpec
from swarm_node.train.device import training_precision
from swarm_node.train.evaluate import BatchParts, average_states, path_val_loss, state_spread, val_batch_count

log = logging.getLogger("swarm_node.local")

# What share of the device's free memory one part of a validation batch may take (the
# estimate below is rough; a part that does not fit is halved and tried again).
EVAL_MEMORY_SHARE = 0.5


class EvaluationStopped(Exception):
    """The run was interrupted during its final evaluation."""


@dataclass
class PathPlan:
    """Which paths to evaluate; ``skipped`` says, per path left out, why."""
    replicas: list[int]
    consensus: bool
    initial: bool
    skipped: list[str] = field(default_factory=list)


def plan_paths(num_stages: int, replicas: int, stage_weights: dict[int, dict[int, dict]],
               dead: dict[tuple[int, int], str]) -> PathPlan:
    """``stage_weights[s][r]``: the weights node r of stage s left; ``dead[(s, r)]``: that
    node died, in a few words (nodes killed on purpose are not in it)."""
    stages = range(num_stages)
    empty = [s for s in stages if not stage_weights.get(s)]
    if empty:
        reasons = [f"stage {s}: no node of it finished ({_why(dead, s)})" for s in empty]
        return PathPlan([], False, False, [*reasons, "every model path (the initial weights too): each needs "
                                                     "every stage"])
    plan = PathPlan([], True, True)
    for r in range(replicas):
        missing = [s for s in stages if r not in stage_weights[s]]
        if not missing:
            plan.replicas.append(r)
            continue
        why = "; ".join(dead.get((s, r), f"stage {s} replica {r} left no weights") for s in missing)
        plan.skipped.append(f"replica {r}: {why}")
    if dead:
        plan.consensus = False
        plan.skipped.append("the consensus model: " + "; ".join(dead[k] for k in sorted(dead)))
    return plan


def _why(dead: dict[tuple[int, int], str], stage: int) -> str:
    return "; ".join(why for (s, _), why in sorted(dead.items()) if s == stage) or "its nodes were lost"


def rows_that_fit(config: ModelConfig, seq_len: int, batch_size: int, device: torch.device) -> int | None:
    """Windows per part of a validation batch on ``device`` (None: the whole batch, off
    CUDA). A forward without autograd holds, per token, the residual stream and a block's
    transients: about 32 bytes per hidden unit and 8 per feed-forward unit."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    per_window = seq_len * (32 * config.hidden_size + 8 * config.intermediate_size)
    return max(1, min(batch_size, int(EVAL_MEMORY_SHARE * free) // per_window))


class FinalEvaluation:
    def __init__(self, spec: RunSpec, data: TokenWindows, *, device: str, batch_size: int, max_batches: int,
                 threads: int, progress: bool, stop: threading.Event):
        self.spec = spec
        self.data = data
        self.device = torch.device(device)
        self.batch_size, self.max_batches, self.threads = batch_size, max_batches, threads
        self.progress_enabled = progress
        self.stop = stop
        self.config, _ = spec.model(data.vocab_size)  # with its coded boundary, if any

    def run(self, stage_weights: dict[int, dict[int, dict]], plan: PathPlan) -> dict:
        stages = range(self.spec.num_stages)
        result = {"initial_val_loss": None, "final_val_loss": None, "final_consensus_val_loss": None,
                  "replica_weight_std": [state_spread(list(stage_weights.get(s,
                                                                             {}).values())) for s in stages],
                  "entropy_floor": self.data.entropy_floor, "eval_device": str(self.device),
                  "evaluation_skipped": plan.skipped}
        if not plan.initial:
            return result
        paths = [("the initial weights", lambda s: None)]
        paths += [(f"replica {r}", lambda s, r=r: stage_weights[s][r]) for r in plan.replicas]
        if plan.consensus:
            paths.append(("the consensus model", lambda s: average_states(list(stage_weights[s].values()))))
        losses = self._evaluate(paths)
        replica_losses = [losses[f"replica {r}"] for r in plan.replicas]
        result.update(initial_val_loss=losses["the initial weights"],
                      final_consensus_val_loss=losses.get("the consensus model"),
                      final_val_loss=float(np.mean(replica_losses)) if replica_losses
                      else losses.get("the consensus model"))
        return result

    def _evaluate(self, paths: list[tuple[str, Callable[[int], dict | None]]]) -> dict[str, float]:
        batches = val_batch_count(self.data, self.batch_size, self.max_batches)
        on_cpu = self.device.type == "cpu"
        replicas = sum(name.startswith("replica") for name, _ in paths)
        what = ", ".join(["the initial weights", f"{replicas} replica{'s' if replicas != 1 else ''}"]
                         + ["the consensus model"] * any(name == "the consensus model" for name, _ in paths))
        where = (f"with {self.threads} torch thread{'s' if self.threads > 1 else ''}" if on_cpu
                 else f"on {self.device}")
        log.info("evaluating %d model paths (%s) on %d validation batch%s of %d windows %s", len(paths), what,
                 batches, "es" if batches > 1 else "", self.batch_size, where)
        progress = EvaluationProgress(len(paths), batches, log, enabled=self.progress_enabled)
        parts = BatchParts(autocast_dtype=training_precision(self.device))
        # Set in this (worker) thread, which does all the work: OpenMP keeps a thread count per
        # OS thread; the previous count is restored afterwards.
        threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        losses = {}
        try:
            for name, weights in paths:
                path = [self._module(s, weights(s)) for s in range(self.spec.num_stages)]
                if parts.rows is None:
                    parts.rows = rows_that_fit(self.config, self.spec.seq_len, self.batch_size, self.device)
                progress.start(name)
                began = time.perf_counter()
                losses[name] = path_val_loss(path, self.data, batch_size=self.batch_size,
                                             max_batches=self.max_batches, device=self.device, parts=parts,
                                             on_batch=lambda: self._batch_done(progress))
                progress.finished(name, losses[name], time.perf_counter() - began)
                del path
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            progress.close()
            torch.set_num_threads(threads_before)
        return losses

    def _batch_done(self, progress: EvaluationProgress) -> None:
        progress.advance()
        if self.stop.is_set():
            raise EvaluationStopped("the run was interrupted")

    def _module(self, stage: int, state: dict | None) -> PipelineStage:
        if self.stop.is_set():
            raise EvaluationStopped("the run was interrupted")
        module = build_stage(self.config, num_stages=self.spec.num_stages, stage_index=stage,
                             seed=self.spec.seed,
                             layers_per_stage=self.spec.layers_per_stage)
        if state is not None:
            module.load_state_dict(state)
        return module.to(self.device)


async def in_daemon_thread(fn: Callable, *args):
    """``fn(*args)`` in a daemon thread: cancelling the await stops waiting for it at once,
    and the process can exit while it finishes (the evaluation checks its stop event).
    asyncio.to_thread's threads would hold up the exit until the work ends."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as exc:  # handed to the awaiting task, whatever it is
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(_settle, future, *outcome)
        except RuntimeError:  # the loop is closed: the run was interrupted and nobody waits
            pass

    threading.Thread(target=run, name="local-evaluation", daemon=True).start()
    return await future


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():  # the awaiting task was cancelled meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)

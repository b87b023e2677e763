"""A local swarm's results: what every node wrote when it stopped, the run's summary
around the final evaluation, the lines it is logged in, and the exit status.

What it owns: reading the nodes' summary and weight files back (a node that died or
was lost is reported as such, its weights left out), the summary's figures (tokens,
tokens/s, the loss curves), and saying them; the processes and the evaluation itself
are local/swarm.py's and local/evaluation.py's."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from swarm_node.local.config import LocalConfig
from swarm_node.local.procs import Child
from swarm_node.spec import RunSpec
from swarm_node.state.checkpoint import PREFIX as CHECKPOINT_PREFIX

log = logging.getLogger("swarm_node.local")


def gather_nodes(children: list[Child], run_dir: Path, num_stages: int,
                 checkpoint_dir: Callable[[int, int], Path | None],
                 checkpoints_kept: bool) -> tuple[list[dict], dict[int, dict[int, dict]]]:
    """Every node's summary entry, and the final weights of those that wrote them
    (``checkpoint_dir``: where a node's checkpoints are, named when ``checkpoints_kept``)."""
    summaries = {}
    for path in run_dir.glob("summary-*.json"):
        data = json.loads(path.read_text())
        summaries[data["pid"]] = data
    peers, stage_weights = [], {s: {} for s in range(num_stages)}
    for child in children:
        info = summaries.get(child.process.pid)
        status = child.status if info is None or child.status in ("lost", "dead") else "finished"
        entry = {"peer_id": None, "stage": child.stage, "replica": child.replica, "pid": child.process.pid,
                 "status": status, "exit_code": child.returncode, "error": child.error,
                 "restarted": child.restarted, "resumed_from_step": None,
                 "inner_steps": 0, "outer_rounds": 0, "rounds_with_partner": 0, "local_only_rounds": 0,
                 "bytes_sent": 0, "bytes_received": 0, "microbatches_done": 0, "microbatches_lost": 0,
                 "retries": 0}
        checkpoints = checkpoint_dir(child.stage, child.replica)
        written = checkpoints_kept and any(checkpoints.glob(f"{CHECKPOINT_PREFIX}*"))
        entry["checkpoint_dir"] = str(checkpoints) if written else None  # where `export` finds this node
        if info is not None:
            entry.update({k: info[k] for k in entry
                          if k in info and k not in ("status", "pid", "restarted", "replica")})
            weights = run_dir / info["weights_file"]
            if weights.exists() and status != "dead":
                stage_weights[child.stage][child.replica] = torch.load(weights, map_location="cpu")
        peers.append(entry)
    return peers, stage_weights


def summary_of(spec: RunSpec, result: dict, peers: list[dict], dead_nodes: list[str], wall_s: float,
               loss_curve: list[tuple[int, float]]) -> dict:
    """The run's summary: the evaluation's ``result`` with every node's figures, the
    tokens trained on and the loss curves."""
    tokens = sum(p["microbatches_done"] for p in peers if p["stage"] == 0) * spec.batch_size * spec.seq_len
    final = result["final_val_loss"]
    initial = result["initial_val_loss"]
    return {**result, "peers": peers, "dead_nodes": dead_nodes, "wall_s": wall_s,
            "tokens": tokens, "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
            # Validation needs every peer's weights, which are collected at the end; the
            # curve during the run is the training loss of the last stage (below).
            "val_loss_curve": ([[0, initial]] if initial is not None else [])
            + ([[tokens, final]] if final is not None else []),
            "train_loss_curve": [[int(t), v] for t, v in loss_curve],
            "run_spec_hash": spec.spec_hash(), "method": spec.method.name}


def log_summary(summary: dict, config: LocalConfig) -> None:
    lost = [p for p in summary["peers"] if p["status"] == "lost"]
    consensus = summary["final_consensus_val_loss"]
    log.info(
        "swarm: final val loss %s%s, %s tokens in %.1f s (%.0f tok/s), evaluated in %.1f s; %d of %d peers "
        "lost",
        f"{summary['final_val_loss']:.4f}" if summary["final_val_loss"] is not None else "n/a",
        f" (consensus model {consensus:.4f})" if consensus is not None else "",
        f"{summary['tokens']:,}",
        summary["wall_s"],
        summary["tokens_per_s"] or 0,
        summary["eval_s"],
        len(lost),
        len(summary["peers"]),
    )
    for p in summary["peers"]:
        log.info(
            "  stage %d %s pid %d: %s, %d steps, %d rounds (%d with a partner), %d micro-batches, %d lost",
            p["stage"],
            (p["peer_id"] or "?")[-6:],
            p["pid"],
            p["status"],
            p["inner_steps"],
            p["outer_rounds"],
            p["rounds_with_partner"],
            p["microbatches_done"],
            p["microbatches_lost"],
        )
    for death in summary["dead_nodes"]:
        log.error("dead: node %s", death[:400])
    for reason in summary["evaluation_skipped"]:
        log.warning("not evaluated: %s", reason)
    log.info(export_hint(summary, config))


def local_exit_status(summary: dict) -> int:
    """0 when every node finished (or was killed on purpose) and the model was evaluated; 1
    when a node died or nothing could be evaluated."""
    return 1 if summary.get("dead_nodes") or summary["final_val_loss"] is None else 0


def export_hint(summary: dict, config: LocalConfig) -> str:
    """How to turn the nodes' checkpoints into one model (or how to keep them next time)."""
    if config.checkpoint_dir is None:
        return "the trained weights are not kept: run with --checkpoint-dir DIR to export a model afterwards"
    dirs = [p["checkpoint_dir"] for p in sorted(summary["peers"],
                                                key=lambda p: p["stage"]) if p.get("checkpoint_dir")]
    if not dirs:
        return f"no node wrote a checkpoint under {config.checkpoint_dir}"
    return (
        "export the model (the replicas of each stage averaged; give one directory per stage for a single "
        f"replica's model): swarm-node export --checkpoint {' '.join(dict.fromkeys(dirs))} --out MODEL_DIR"
    )

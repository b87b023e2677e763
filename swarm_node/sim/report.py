"""The simulator's outputs: the JSON summary, a PNG of the curves, a console summary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from swarm_node.sim.simulator import SimResult

MAX_CURVE_POINTS = 500


def _downsample(curve: list[tuple[int, float]], max_points: int = MAX_CURVE_POINTS) -> list[list[float]]:
    """Bucket means, so a long run's train curve stays readable and small."""
    if len(curve) <= max_points:
        return [[int(t), float(v)] for t, v in curve]
    size = len(curve) / max_points
    out = []
    for b in range(max_points):
        bucket = curve[int(b * size):int((b + 1) * size)]
        out.append([int(bucket[-1][0]), sum(v for _, v in bucket) / len(bucket)])
    return out


def result_to_json(result: SimResult) -> dict:
    cfg = result.config
    floor = result.entropy_floor
    first_val = result.val_loss_curve[0][1]
    excess = None
    if floor is not None and first_val > floor:
        excess = (result.final_val_loss - floor) / (first_val - floor)
    return {
        "method": cfg.method.name,
        "final_val_loss": result.final_val_loss,
        "final_consensus_val_loss": result.final_consensus_val_loss,
        "val_loss_curve": [[int(t), float(v)] for t, v in result.val_loss_curve],
        "train_loss_curve": _downsample(result.train_loss_curve),
        "replica_weight_std": result.replica_weight_std,
        "tokens": result.tokens,
        "wall_s": result.wall_s,
        "tokens_per_s": result.tokens / result.wall_s if result.wall_s > 0 else None,
        "entropy_floor": floor,
        "excess_loss_ratio": excess,
        "outer_rounds": result.outer_rounds,
        "num_parameters": result.num_parameters,
        "config": {
            "replicas": cfg.replicas, "stages": cfg.stages, "model": cfg.model_size,
            "data": dataclasses.asdict(cfg.data), "seq_len": cfg.seq_len, "batch_size": cfg.batch_size,
            "steps": cfg.steps, "seed": cfg.seed, "routing": cfg.routing,
            "activation_codec": cfg.activation_codec,
            "activation_ratio": cfg.activation_ratio, "outer_codec": cfg.outer_codec,
            "method": {"name": cfg.method.name, "inner_steps": cfg.method.inner_steps,
                       "group_size": cfg.method.group_size,
                       "outer": dataclasses.asdict(cfg.method.outer) if cfg.method.outer else None},
            "inner": dataclasses.asdict(cfg.inner), "device": cfg.device,
        },
    }


def write_json(result: SimResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_to_json(result), indent=2) + "\n")


def write_plot(result: SimResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    train = _downsample(result.train_loss_curve, 200)
    ax.plot([t for t, _ in train], [v for _, v in train], color="#9bb7d4", lw=1,
            label="train (per-step mean)")
    ax.plot([t for t, _ in result.val_loss_curve], [v for _, v in result.val_loss_curve], color="#1f4e79",
            lw=2, marker="o", ms=3, label="validation")
    if result.entropy_floor is not None:
        ax.axhline(result.entropy_floor, color="#b03a2e", ls="--", lw=1, label="entropy floor")
    cfg = result.config
    ax.set_title(f"{cfg.method.name}: {cfg.replicas} replicas x {cfg.stages} stages, {cfg.model_size} model")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def summary_lines(result: SimResult) -> list[str]:
    data = result_to_json(result)
    lines = [
        f"method {data['method']}: final val loss {data['final_val_loss']:.4f} "
        f"(consensus model {data['final_consensus_val_loss']:.4f}), "
        f"{data['tokens']:,} tokens in {data['wall_s']:.1f} s ({data['tokens_per_s']:,.0f} tok/s)",
        "replica weight std per stage: " + ", ".join(f"{s:.2e}" for s in data["replica_weight_std"])
        + f"; outer rounds: {data['outer_rounds']}",
    ]
    if data["entropy_floor"] is not None:
        lines.append(f"entropy floor {data['entropy_floor']:.4f}; excess loss now "
                     f"{100 * (data['excess_loss_ratio'] or 0):.1f}% of its initial value")
    return lines

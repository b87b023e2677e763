"""bench.state_check's plot and its BENCHMARKS.md section, from the result's rows."""

from __future__ import annotations

from pathlib import Path

from bench.common.results import grouped_bars, pyplot, rerun_command, save_plot

NAME = "state_check"


def plot(rows: list[dict], out_dir: Path) -> Path | None:
    """Share of checks refused, per case, one group of bars per swarm."""
    if not rows:
        return None
    plt = pyplot()
    swarms = list(dict.fromkeys(r["swarm"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    by = {(r["swarm"], r["case"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(swarms)), 4.0))
    grouped_bars(
        ax, swarms, cases, lambda s, case: 100 * by[(s, case)]["refused_share"] if (s, case) in by else 0
    )
    ax.set_xticklabels([s.replace(", ", "\n") for s in swarms], fontsize=8)
    ax.set_ylabel("% of checks refused")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="center right")
    ax.set_title("downloaded states refused: honest ones should be 0 %, hostile ones 100 %")
    return save_plot(fig, out_dir, NAME)


def markdown(result: dict) -> str:
    rows = result["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    swarms = list(dict.fromkeys(r["swarm"] for r in rows))
    by = {(r["swarm"], r["case"]): r for r in rows}
    lines = [
        f"## {NAME}: a downloaded state checked against the other replicas",
        "",
        f"`{rerun_command(NAME, result['mode'])}` ({result['mode']} mode, {result['wall_s']:.0f} s)",
        "",
        result.get("command_note", "")
        or "Refused / checked, per case, on in-process swarms of the simulator (debug model, bundled corpus, "
        "2 stages; swarm_node/state/check.py as the node runs it). Honest: every replica's state at every "
        "round, checked against all the others' sketches, at once, a round behind them and two steps into "
        "the next round. The other cases are issue 33's hostile donor from round 20 on.",
        "",
        "| swarm | " + " | ".join(cases) + " |",
        "|---|" + "---|" * len(cases),
    ]
    for swarm in swarms:
        cells = []
        for case in cases:
            row = by.get((swarm, case))
            cells.append(f"{row['refused']} / {row['checked']}" if row else "")
        lines.append(f"| {swarm} | " + " | ".join(cells) + " |")
    worst = result["summary"].get("worst_honest_distance_ratio", {})
    cost = result["summary"].get("sketch_cost_small_stage")
    lines += [
        "",
        "Honest states' phi distance at the closest witness, as a share of the tolerance, at its largest: "
        + ", ".join(f"{s}: {v:.2f}" for s, v in worst.items())
        + ".",
    ]
    if cost:
        lines += [
            "",
            f"A sketch of a `small` stage's state ({cost['parameters'] / 1e6:.1f}M parameters: theta, phi "
            f"and momentum, {cost['state_bytes'] / 1e6:.0f} MB) took {cost['seconds']:.2f} s on one CPU "
            f"thread ({cost['state_mb_per_s']:.0f} MB/s of state).",
        ]
    lines += [""] + [f"- {n}" for n in result.get("notes", [])]
    lines += ["", f"![refused share by case](bench/results/{NAME}.png)"]
    return "\n".join(lines)

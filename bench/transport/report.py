"""bench.transport's plot and its BENCHMARKS.md section, from the result's rows."""

from __future__ import annotations

from pathlib import Path

from bench.common.results import grouped_bars, pyplot, rerun_command, save_plot

NAME = "transport"


def plot(rows: list[dict], out_dir: Path) -> Path | None:
    """MB/s per way, one group of bars per path."""
    if not rows:
        return None
    plt = pyplot()
    paths = list(dict.fromkeys(r["path"] for r in rows))
    ways = list(dict.fromkeys(r["way"] for r in rows))
    by = {(r["path"], r["way"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(7.0, 1.8 * len(paths)), 4.2))
    grouped_bars(ax, paths, ways, lambda p, way: by[(p, way)]["mb_s"] if (p, way) in by else 0)
    ax.set_xticklabels([p.replace(", ", "\n") for p in paths], fontsize=8)
    ax.set_ylabel("MB/s, one transfer")
    ax.legend(fontsize=7)
    ax.set_title("one bulk transfer between two nodes, beside raw TCP on the same path")
    return save_plot(fig, out_dir, NAME)


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [f"## {NAME}: one bulk transfer, libp2p vs direct lanes vs raw TCP", "",
             f"`{rerun_command(NAME, result['mode'])}` ({result['mode']} mode, {result['wall_s']:.0f} s)", "",
             "| path | way | MB/s | of raw TCP | of the link |", "|---|---|---|---|---|"]
    for r in rows:
        link = f"{100 * r['of_link']:.0f} %" if r.get("of_link") is not None else ""
        lines.append(f"| {r['path']} | {r['way']} | {r['mb_s']:,.0f} | {100 * r['of_raw']:.0f} % | {link} |")
    lines += [""] + [f"- {n}" for n in result.get("notes", [])]
    lines += ["", f"![MB/s by path](bench/results/{NAME}.png)"]
    return "\n".join(lines)

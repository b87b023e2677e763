"""Plots and the BENCHMARKS.md section of the latency-model benchmark, drawn only from its
result rows and summary (bench/results/latency_model.json)."""

from __future__ import annotations

import math
from pathlib import Path

from bench.common.results import pyplot, rerun_command

ALLREDUCE_QUANTITY = "all-reduce / pair critical path"


def _rows(rows: list[dict], table: str, **match) -> list[dict]:
    return [r for r in rows if r["table"] == table and all(r[k] == v for k, v in match.items())]


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _seconds(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


# ---- plots ----

def plot(rows: list[dict], out_dir: Path) -> None:
    plt = pyplot()
    _plot_allreduce(plt, rows, out_dir / "latency_model.png")
    _plot_barrier(plt, rows, out_dir / "latency_model_barrier.png")


def _save(plt, fig, ax, path: Path) -> None:
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _curve_with_paper(ax, curve: list[dict], x: str, label: str, papers: list[dict]):
    """A ratio curve, and the paper's figures as crosses in its colour."""
    line, = ax.plot([r[x] for r in curve], [r["ratio"] for r in curve], marker="o", ms=3, label=label)
    for paper in papers:
        ax.plot([paper["n"]], [paper["paper"]], marker="x", ms=10, mew=2, color=line.get_color())
    return line


def _plot_allreduce(plt, rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cv in sorted({r["cv"] for r in _rows(rows, "allreduce_curve")}):
        curve = _rows(rows, "allreduce_curve", cv=cv)
        _curve_with_paper(ax, curve, "n_peers", f"std/t = {cv:g}",
                          _rows(rows, "paper_check", quantity=ALLREDUCE_QUANTITY, cv=cv))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_yticks([1, 2, 5, 10, 20, 50], labels=["1", "2", "5", "10", "20", "50"])
    ax.set(xlabel="peers N", ylabel="all-reduce / pair exchange, critical path",
           title="Tree all-reduce vs one pair exchange (x: the paper's figures)")
    _save(plt, fig, ax, path)


def _plot_barrier(plt, rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for h in sorted({r["inner_steps"] for r in _rows(rows, "barrier_curve")}):
        curve = _rows(rows, "barrier_curve", inner_steps=h)
        line = _curve_with_paper(ax, curve, "n_workers", f"H = {h}, paper's step times",
                                 [r for r in _rows(rows, "paper_check") if r["h"] == h])
        measured = _rows(rows, "measured_steps", message_label="", inner_steps=h)
        if measured:
            ax.plot([r["n_workers"] for r in measured], [r["ratio"] for r in measured], ls="none", marker="s",
                    color=line.get_color(),
                    label=f"H = {h}, measured step spread (std/t = {measured[0]['step_cv']:.2f})")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="workers N", ylabel="DiLoCo / NoLoCo run time",
           title="Global barrier vs pairwise waits (x: the paper's figures)")
    _save(plt, fig, ax, path)


# ---- tables ----

def _table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(cells) + " |" for cells in lines])


def _simulated(r: dict) -> str:
    decimals = 3 if r["paper_rounding"] < 0.1 else 2  # one digit more than the paper gives
    return f"{r['simulated']:.{decimals}f}"


def _paper_table(rows: list[dict]) -> str:
    return _table(["quantity", "setting", "simulated", "paper", "rel. diff"],
                  [[r["quantity"], r["setting"],
                    _simulated(r) + (f" ± {r['stderr']:.2g}" if r["stderr"] else ""),
                    f"{r['paper']:g}", _pct(r["rel_diff"])]
                   for r in _rows(rows, "paper_check")])


def _curve_table(rows: list[dict]) -> str:
    ratio = {(r["n_peers"], r["cv"]): r["ratio"] for r in _rows(rows, "allreduce_curve")}
    cvs, ns = sorted({cv for _, cv in ratio}), sorted({n for n, _ in ratio})
    return _table(["N"] + [f"std/t = {cv:g}" for cv in cvs], [[str(n)] + [f"{ratio[n, cv]:.2f}" for cv in cvs]
                                                              for n in ns])


def _interpretation_table(rows: list[dict], summary: dict) -> str:
    interp = _rows(rows, "interpretation")
    cvs = sorted({r["cv"] for r in interp})
    diffs = summary["interpretation_mean_abs_rel_diff"]
    papers = {r["cv"]: r["paper"] for r in interp}
    lines = [["paper", ""] + [f"{papers[cv]:g}" for cv in cvs] + [""]]
    for name in diffs:
        mine = [r for r in interp if r["interpretation"] == name]
        lines.append(
            [name, mine[0]["how"]]
            + [f"{r['ratio_at_1024']:.1f}" for cv in cvs for r in mine if r["cv"] == cv]
            + [f"{diffs[name] * 100:.0f}%"]
        )
    return _table(["reading", "meaning"] + [f"std/t = {cv:g}" for cv in cvs] + ["mean abs. diff (std/t > 0)"],
                  lines)


def _barrier_table(rows: list[dict]) -> str:
    curve = _rows(rows, "barrier_curve")
    hs = sorted({r["inner_steps"] for r in curve})
    return _table(["N"] + [f"H = {h}: DiLoCo / NoLoCo (idle share)" for h in hs],
                  [[str(n)] + [f"{r['ratio']:.3f} ({r['idle_fraction'] * 100:.0f}%)"
                               for h in hs for r in _rows(curve, "barrier_curve", n_workers=n, inner_steps=h)]
                   for n in sorted({r["n_workers"] for r in curve})])


def _message_table(rows: list[dict]) -> str:
    """Per measured message time t: an all-reduce among many peers against one pair exchange, in seconds."""
    messages = _rows(rows, "measured_messages")
    cvs = sorted({r["cv"] for r in messages})
    cell = {(r["label"],
             r["cv"]): f"{_seconds(r['allreduce_s'])} vs {_seconds(r['pair_s'])}" for r in messages}
    labels = {r["label"]: r["mean_s"] for r in messages}
    measured = {r["cv"] for r in messages if r["cv_source"] == "measured"}
    return _table(["setting / params", "message t"]
                  + [f"std/t = {cv:.2g}" + (" (measured)" if cv in measured else "") for cv in cvs],
                  [[lab, _seconds(mean_s)] + [cell.get((lab, cv), "") for cv in cvs]
                   for lab, mean_s in labels.items()])


def _projected_n(rows: list[dict]) -> int | None:
    return next((r["n_peers"] for r in _rows(rows, "measured_messages")), None)


def _small_n_table(rows: list[dict]) -> str:
    small = _rows(rows, "measured_small_n")
    ns = sorted({r["n_peers"] for r in small})
    lines = []
    for lab in dict.fromkeys(r["label"] for r in small):
        cells = {r["n_peers"]: r for r in small if r["label"] == lab}
        lines.append(
            [lab]
            + [
                f"{cells[n]['measured']:.2f} ({cells[n]['model_equal_times']:.0f})" if n in cells else ""
                for n in ns
            ]
        )
    return _table(["setting / params"] + [f"N = {n}: measured (model)" for n in ns], lines)


def _step_table(rows: list[dict]) -> str:
    steps = _rows(rows, "measured_steps")
    return _table(["step times", "mean", "std/t", "messages (t, std/t)", "N", "H", "DiLoCo round",
                   "NoLoCo round",
                   "DiLoCo / NoLoCo"],
                  [[r["step_label"], _seconds(r["step_mean_s"]), f"{r['step_cv']:.2f}",
                    f"{r['message_label']} ({_seconds(r['message_mean_s'])}, {r['message_cv']:.2g})"
                    if r["message_label"] else "none (compute only)",
                    str(r["n_workers"]), str(r["inner_steps"]), _seconds(r["diloco_round_s"]),
                    _seconds(r["noloco_round_s"]), f"{r['ratio']:.3f}"] for r in steps])


# ---- text ----

def _agreement(rows: list[dict]) -> str:
    """Which check rows miss the paper by more than its rounding, and whether that is
    beyond our Monte Carlo error."""
    check = _rows(rows, "paper_check")
    outside = [r for r in check if abs(r["simulated"] - r["paper"]) > r["paper_rounding"]]
    text = (
        f"{len(check) - len(outside)} of {len(check)} simulated figures agree with the paper's to its "
        f"rounding (whole numbers for the ratio, two decimals for the barrier); all are within "
        f"{max(abs(r['rel_diff']) for r in check) * 100:.1f}% of it."
    )
    if outside:
        misses = "; ".join(
            f"{r['setting']}: {_simulated(r)} against {r['paper']:g}, {_pct(r['rel_diff'])}"
            + (f", Monte Carlo error ± {r['stderr']:.2g}" if r["stderr"] else "")
            for r in outside
        )
        text += f" Outside the rounding: {misses}."
        if any(r["stderr"] and abs(r["simulated"] - r["paper"]) > r["paper_rounding"] + 3 * r["stderr"]
               for r in outside):
            text += (
                " That is beyond our Monte Carlo error, so it is a difference in the model's details (the "
                "paper states neither its tree layout nor its sample count), not noise."
            )
    return text


def _interpretation_text(summary: dict) -> str:
    diffs, used = summary["interpretation_mean_abs_rel_diff"], summary["interpretation_used"]
    ranked = sorted(diffs, key=diffs.get)
    if ranked[0] != used:
        return (
            f"Note: the reading \"{ranked[0]}\" ({diffs[ranked[0]] * 100:.0f}% mean absolute difference) "
            f"matches the paper more closely than the one reported, \"{used}\" ({diffs[used] * 100:.0f}%)."
        )
    return (
        f"Of the readings tried, \"{used}\" is the closest to the paper ({diffs[used] * 100:.0f}% mean "
        f"absolute difference); the next, \"{ranked[1]}\", is {diffs[ranked[1]] * 100:.0f}% off, so we take "
        f"it to be the model behind the paper's figures."
    )


def _meaning(result: dict) -> str:
    s = result["summary"]
    ratios, barrier = s["allreduce_ratio_at_1024"], s["barrier_ratio"]
    cvs = sorted({r["cv"] for r in _rows(result["rows"], "allreduce_curve")})
    return (
        f"At N = 1024 a tree all-reduce's critical path is {min(ratios.values()):.1f}x to "
        f"{max(ratios.values()):.1f}x that of one pair exchange as the spread of message times grows from "
        f"std/t = {cvs[0]:g} to {cvs[-1]:g}: the tree waits for the slower message at every merge of every "
        f"level, a pair only for its own two. DiLoCo's global barrier makes a run "
        f"{(barrier['N = 1024, H = 100'] - 1) * 100:.0f}% longer than NoLoCo's pairwise waits at N = 1024, "
        f"H = 100 ({(barrier['N = 1024, H = 50'] - 1) * 100:.0f}% at H = 50, "
        f"{(barrier['N = 16, H = 100'] - 1) * 100:.0f}% at N = 16), even though a NoLoCo worker carries each "
        f"delay on to its later partners. {_agreement(result['rows'])} {_interpretation_text(s)}"
    )


def _measured_text(result: dict) -> str:
    rows, s = result["rows"], result["summary"]
    parts = []
    small = _rows(rows, "measured_small_n")
    if small:
        above = [r for r in small if r["measured"] > r["model_equal_times"]]
        parts.append(
            f"At small N, hivemind's all-reduce took more time relative to a pair round than the tree model "
            f"with equal message times predicts in {len(above)} of {len(small)} cases. The two are not "
            "the same algorithm: hivemind's all-reduce is a butterfly (each peer reduces 1/N of the tensor "
            "and exchanges parts with every other peer), so its bytes per peer stay near two payloads "
            "whatever N, while the tree sends whole payloads down 2 log2(N) sequential levels."
        )
    measured = s.get("measured_barrier_ratio") or {}
    key = "N = 1024, H = 100"
    if key in measured:
        spread = next(r["step_cv"] for r in _rows(rows, "measured_steps"))
        paper = s["step_lognormal"]
        paper_cv = math.sqrt(math.expm1(paper["sigma2"]))  # std/mean of a log-normal
        parts.append(
            f"With the inner-step spread measured on this machine (std/t = {spread:.2f}; the paper's "
            f"LogNormal({paper['mu']:g}, {paper['sigma2']:g}) has {paper_cv:.2f}) the global barrier "
            f"costs DiLoCo {(measured[key] - 1) * 100:.0f}% at {key} (paper's spread: "
            f"{(s['barrier_ratio'][key] - 1) * 100:.0f}%)."
        )
    rounds = s.get("measured_round_ratio") or {}
    if rounds:
        best, worst = min(rounds, key=rounds.get), max(rounds, key=rounds.get)
        parts.append(f"Whole outer rounds with measured steps and messages: DiLoCo / NoLoCo ranges from "
                     f"{rounds[best]:.2f} ({best}) to {rounds[worst]:.2f} ({worst}).")
    return " ".join(parts)


def _measured_section(result: dict) -> str:
    rows, s = result["rows"], result["summary"]
    tables = [
        (
            f"Measured message times projected: a tree all-reduce among {_projected_n(rows)} peers vs one "
            f"pair exchange (seconds), at each spread of message times:",
            _message_table,
            "measured_messages",
        ),
        (
            "Measured all-reduce / pair round times at small N (bench.sync_cost) and the tree model with "
            "equal message times:",
            _small_n_table,
            "measured_small_n",
        ),
        (
            "Measured inner-step times: DiLoCo / NoLoCo, compute only and whole outer rounds:",
            _step_table,
            "measured_steps",
        ),
    ]
    parts = ["\n".join(f"- {text}" for text in s["input_sources"].values())]
    parts += [f"{title}\n\n{table(rows)}" for title, table, name in tables if _rows(rows, name)]
    if len(parts) == 1:
        parts.append(
            "Run `bench.sync_cost` and `bench.swarm_efficiency` first (`make bench` does) to project "
            "the model with this machine's message and inner-step times."
        )
    parts += [_measured_text(result), "\n".join(f"- {text}" for text in result["notes"])]
    return "\n\n".join(part for part in parts if part)


def markdown(result: dict) -> str:
    rows, s = result["rows"], result["summary"]
    step = f"LogNormal({s['step_lognormal']['mu']:g}, {s['step_lognormal']['sigma2']:g})"
    return f"""## latency_model: the paper's section 5.3 latency model at N up to 1024

```bash
{rerun_command('latency_model', result['mode'])}
```

A numpy Monte Carlo of the NoLoCo paper's latency model, no network ({result['mode']} mode).
**Communication**: a binary-tree all-reduce among N peers against one pair exchange, message
times log-normal with mean t. The pair in the ratio is the expected time of one pair exchange
(two phases, each the slower of two concurrent messages; exactly 2 t with equal times), not the
slowest of all pairs: NoLoCo has no global barrier, so a peer only waits for its own partner.
**Idle time**: inner-step times ~ {step}; every H steps DiLoCo waits for the slowest
of N workers, NoLoCo only for a random partner (whose clock carries its earlier partners' delays);
runs of {s['run_inner_steps']:,} inner steps from a common start (NoLoCo's ends when its last worker
is done), both methods on the same step draws.

{_paper_table(rows)}

{_meaning(result)}

![all-reduce vs pair](bench/results/latency_model.png)

All-reduce / pair critical path by N:

{_curve_table(rows)}

Which reading of "all-reduce / pair" the paper's figures imply (ratio at N = 1024):

{_interpretation_table(rows, s)}

![global barrier vs pairwise waits](bench/results/latency_model_barrier.png)

DiLoCo / NoLoCo run time by N (idle share: the part of DiLoCo's time that NoLoCo does not spend):

{_barrier_table(rows)}

### Fed with measured times

{_measured_section(result)}
"""

"""The convergence benchmark's plot and BENCHMARKS.md section, from the result JSON alone."""

from __future__ import annotations

import statistics

from bench.common.results import rerun_command
from bench.convergence.plan import NOLOCO_DEFAULT
from bench.convergence.stats import METHOD_ORDER

NAME = "convergence"
METHOD_COLOURS = {"ddp": "#1f4e79", "noloco": "#2e8b57", "diloco": "#c0642f", "local": "#8c8c8c"}
CHECK_TITLES = {"ddp_best": "DDP best", "local_worst": "local-only worst",
                "noloco_le_diloco": "NoLoCo at or below DiLoCo",
                "gaps_grow_with_dp": "gaps growing with DP", "scaling_order": "DiLoCo's excess rising with M"}


def _rows(rows: list[dict], kind: str) -> list[dict]:
    return [r for r in rows if r["kind"] == kind]


def _min_max_bars(means: list[float], lows: list[float], highs: list[float]) -> list[list[float]]:
    return [[m - lo for m, lo in zip(means, lows)], [hi - m for m, hi in zip(means, highs)]]


def _mean_curve(runs: list[dict]) -> tuple[list[int], list[float]]:
    curves = [r["loss_curve"] for r in runs]
    steps = [p[0] for p in curves[0]]
    return steps, [statistics.fmean(c[i][1] for c in curves) for i in range(len(steps))]


def plot(rows: list[dict], path, plt) -> None:
    """Left: perplexity per grid and method (mean, bars min-max over seeds). Middle:
    DiLoCo's excess over DDP by M. Right: validation loss against steps on the sweep's grid."""
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.2), dpi=110)
    per_grid = _rows(rows, "grid")
    grids = list(dict.fromkeys(r["grid"] for r in per_grid))
    for k, method in enumerate(METHOD_ORDER):
        mine = [next((r for r in per_grid if r["grid"] == g and r["method"] == method), None) for g in grids]
        points = [(i + (k - 1.5) * 0.15, r) for i, r in enumerate(mine) if r is not None]
        means = [r["ppl_mean"] for _, r in points]
        left.errorbar([x for x, _ in points], means, fmt="o", capsize=3, color=METHOD_COLOURS[method],
                      label=method,
                      yerr=_min_max_bars(means, [r["ppl_min"] for _, r in points],
                                         [r["ppl_max"] for _, r in points]))
    left.set_xticks(range(len(grids)), [f"DP x PP = {g}" for g in grids])
    left.set_ylabel("validation perplexity, random paths (bytes)")
    left.set_title("perplexity at equal tokens (bars: min-max over seeds)")
    left.grid(alpha=0.3, axis="y")
    left.legend()
    scaling = sorted(_rows(rows, "scaling"), key=lambda r: r["m"])
    ms = [r["m"] for r in scaling]
    means = [r["excess_pct"] for r in scaling]
    middle.errorbar(ms, means, fmt="o-", capsize=3, color=METHOD_COLOURS["diloco"], label="DiLoCo, this run",
                    yerr=_min_max_bars(means, [r["excess_min_pct"] for r in scaling],
                                       [r["excess_max_pct"] for r in scaling]))
    for key, style in (("paper_35m_excess_pct", "--"), ("paper_2_4b_excess_pct", ":")):
        middle.plot(ms, [r[key] for r in scaling], style, color="#555555",
                    label="paper, " + ("35M" if "35m" in key else "2.4B"))
    middle.axhline(0, color=METHOD_COLOURS["ddp"], lw=1, label="DDP")
    middle.set_xscale("log", base=2)
    middle.set_xticks(ms, [str(m) for m in ms])
    middle.set_xlabel("DiLoCo replicas M (PP = 1), best outer lr each")
    middle.set_ylabel("eval loss over DDP's (%)")
    middle.set_title("DiLoCo scaling-law ordering")
    middle.grid(alpha=0.3)
    middle.legend()
    sweep = next((r for r in _rows(rows, "sweep")), None)
    runs = [r for r in _rows(rows, "run") if r["section"] == "grid"]
    grid = sweep["grid"] if sweep else grids[0]
    for method in METHOD_ORDER:
        mine = [r for r in runs if f"{r['dp']} x {r['pp']}" == grid and r["method"] == method]
        if mine:
            steps, losses = _mean_curve(mine)
            right.plot(steps, losses, color=METHOD_COLOURS[method], label=method)
    right.set_xlabel("inner step")
    right.set_ylabel("validation loss, random paths (mean over seeds)")
    right.set_title(f"loss curve, DP x PP = {grid}")
    right.grid(alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- BENCHMARKS.md ----------------------------------------------------------------
def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:+.{digits}f} %"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _yes(flag: bool) -> str:
    return "**yes**" if flag else "**no**"


def _momentum_text(run: dict) -> str:
    return f"{'Nesterov' if run['nesterov'] else 'heavy-ball'} momentum {run['outer_momentum']}"


def _setup(result: dict) -> str:
    s = result["summary"]
    runs = _rows(result["rows"], "run")
    noloco = next(r for r in runs if r["method"] == "noloco" and r["section"] == "grid")
    diloco = next(r for r in runs if r["method"] == "diloco" and r["section"] == "grid")
    tuned = sorted((r for r in runs if r["section"] == "tune"), key=lambda r: r["inner_lr"])
    tuning = (
        (
            "the inner lr tuned once for DDP on grid "
            f"{tuned[0]['dp']} x {tuned[0]['pp']} (seed {tuned[0]['seed']}: "
            + ", ".join(f"lr {r['inner_lr']:g} -> ppl {r['ppl']:.3f}" for r in tuned)
            + f") and used by every method: {s['inner_lr']:g}"
        )
        if tuned
        else f"the `{s['model']}` model's suggested inner lr {s['inner_lr']:g}"
    )
    return (
        f"The project's simulator (`swarm_node.sim`: the real AdamW inner step and outer step, a fresh "
        f"random route per micro-batch between stages) trains DP replicas x PP stages of the `{s['model']}` "
        f"model ({s['num_parameters']:,} parameters) on the bundled corpus (CPython docstrings, byte "
        f"tokens): {s['steps']} inner steps of a fixed global batch of {s['global_batch']} x {s['seq_len']} "
        f"tokens, split over the DP replicas, so every method and grid sees the same {s['tokens_per_run']:,} "
        f"tokens. Seeds {', '.join(map(str, s['seeds']))}; a seed fixes the initial weights and data order "
        f"of all methods, so gaps are paired by seed. Inner: AdamW, warm-up then cosine, {tuning}. Outer: "
        f"NoLoCo H = {noloco['inner_steps']} ({noloco['outer_rounds']} rounds), heavy-ball momentum "
        f"{noloco['outer_momentum']}, outer lr {noloco['outer_lr']}, gamma {noloco['outer_gamma']}, pairs; "
        f"DiLoCo H = {diloco['inner_steps']} ({diloco['outer_rounds']} rounds), heavy-ball momentum "
        f"{diloco['outer_momentum']}, outer lr {diloco['outer_lr']} (the reference code's). The scaling rows "
        f"take the scaling-law paper's outer optimizer, Nesterov momentum {s['scaling_momentum']}, with the "
        f"outer lr swept per M. Perplexity is exp of the mean validation loss over random paths (each batch "
        f"through DP paths of a random worker per stage, the same draws for every run: how a swarm routes) "
        f"on {s['val_windows']} of the corpus's {s['all_val_windows']} held-out windows; \"fixed\" over the "
        f"paths \"worker r at every stage\" (what fixed routing trains), \"consensus\" one model of each "
        f"stage's mean weights."
    )


def _grid_table(rows: list[dict], grid: str) -> str:
    lines = [
        f"**DP x PP = {grid}**",
        "",
        "| method | perplexity, random paths (mean) | spread: std; min-max | gap to DDP (min..max over "
        "seeds) | fixed paths | consensus | paper ppl (Small, C4) | paper gap to FSDP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["kind"] == "grid" and r["grid"] == grid):
        gap = "0 (reference)" if r["method"] == "ddp" else \
            f"{_pct(r['gap_to_ddp_pct'], 2)} ({r['gap_min_pct']:+.2f}..{r['gap_max_pct']:+.2f})"
        lines.append(
            f"| {r['method']} | {r['ppl_mean']:.3f} | {r['ppl_std']:.3f}; {r['ppl_min']:.3f}-"
            f"{r['ppl_max']:.3f} | {gap} | {r['fixed_ppl_mean']:.3f} | {r['consensus_ppl_mean']:.3f} | "
            f"{_num(r['paper_ppl'], 1)} | {_pct(r['paper_gap_pct']) if r['method'] != 'ddp' else '-'} |"
        )
    return "\n".join(lines)


def _scaling_table(result: dict) -> str:
    sweep = _rows(result["rows"], "scaling_sweep")
    tried = "; ".join(
        f"M {m}: "
        + ", ".join(
            f"{r['outer_lr']:g} -> {r['val_loss']:.4f}" + (" (best)" if r["chosen"] else "")
            for r in sweep
            if r["m"] == m
        )
        for m in dict.fromkeys(r["m"] for r in sweep)
    )
    lines = [
        f"DiLoCo with M replicas (PP = 1, the same global batch) against DDP on grid "
        f"{result['summary']['scaling_reference']}, eval loss in nats per byte. The outer lr was swept on "
        f"the first seed (outer lr -> eval loss: {tried}); the best one ran on every seed:",
        "",
        "| M | outer lr, momentum | DiLoCo eval loss (mean ± std) | DDP eval loss | excess over DDP "
        "(min..max) | paper 35M | paper 2.4B |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in _rows(result["rows"], "scaling"):
        lines.append(
            f"| {r['m']} | {r['outer_lr']}, {_momentum_text(r)} | "
            f"{r['val_loss_mean']:.4f} ± {r['val_loss_std']:.4f} | "
            f"{_num(r['ddp_val_loss_mean'], 4)} | {_pct(r['excess_pct'], 2)} ({r['excess_min_pct']:+.2f}.."
            f"{r['excess_max_pct']:+.2f}) | {_pct(r['paper_35m_excess_pct'])} | "
            f"{_pct(r['paper_2_4b_excess_pct'])} |"
        )
    return "\n".join(lines)


def _sweep_table(result: dict) -> str:
    s = result["summary"]
    rows = _rows(result["rows"], "sweep")
    lines = [
        f"**NoLoCo's open settings** on grid {s['sweep_grid']} (pipeline stages, random routing), one at a "
        f"time from the paper's settings (alpha = momentum, beta = outer lr, gamma = pull towards the pair's "
        f"mean); chosen on seed {s['seeds'][0]}: **{s['noloco_choice']}**.",
        "",
        "| setting | outer gain beta/(1-alpha) | eval loss, first seed | seeds | gap to the paper's (paired) "
        "| eval-loss gap to DiLoCo (min..max) | weight spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        to_diloco = (
            "-"
            if r["gap_to_diloco_pct"] is None
            else (
                f"{r['gap_to_diloco_pct']:+.2f} % "
                f"({r['gap_to_diloco_min_pct']:+.2f}..{r['gap_to_diloco_max_pct']:+.2f})"
            )
        )
        setting = "the paper's" if r["variant"] == NOLOCO_DEFAULT else r["variant"]
        lines.append(f"| {setting} | {_num(r.get('outer_gain'), 2)} | {_num(r['first_seed_val_loss'], 4)} | "
                     f"{r['seeds']} | "
                     f"{_pct(r['gap_to_default_pct'], 2)} | {to_diloco} | {r['weight_std_mean']:.2e} |")
    return "\n".join(lines)


def _wire_table(result: dict) -> str:
    rows = _rows(result["rows"], "wire")
    if not rows:
        return ""
    choice = next((r["variant"].split("; ", 1)[1] for r in rows if "; " in r["variant"]), None)
    at_choice = (
        f"; then the main variants again at the setting the NoLoCo sweep chose ({choice}), each against "
        "the blocking round at that setting"
        if choice
        else ""
    )
    lines = [
        f"**How a round moves** (issue 16) on grid {rows[0]['grid']}, NoLoCo at the paper's "
        f"settings{at_choice}, every seed: the overlapped round (ALGORITHM.md 3.1) landing half a round to "
        f"two rounds late, the outer payload in near4-3 (3.2), activations and their gradients in int8, each "
        f"against the blocking round with phi, Delta and activations in 16 bits, paired by seed; the bar is "
        f"1 %. A round is never more than one behind: one still under way at the next boundary holds the "
        f"steps there until it lands, so two rounds late trains as one round late (the wait is idle time, "
        f"not tokens).",
        "",
        "| variant | payload | activations | lands (steps late) | eval loss (mean ± std) | "
        "gap to blocking fp16, same setting (min..max) | within 1 % |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = "-" if r["gap_pct"] is None else (
            f"{r['gap_pct']:+.2f} % ({r['gap_min_pct']:+.2f}..{r['gap_max_pct']:+.2f})")
        late = "blocking" if r["outer_latency_steps"] is None else str(r["outer_latency_steps"])
        lines.append(f"| {r['variant']} | {r['outer_codec']} | {r['activation_codec']} | {late} | "
                     f"{r['val_loss_mean']:.4f} ± {r['val_loss_std']:.4f} | {gap} | "
                     f"{'yes' if r['within_bar'] else 'no'} |")
    return "\n".join(lines)


def _wall_table(result: dict) -> str:
    s = result["summary"]
    walls = _rows(result["rows"], "wall")
    home = s.get("home_link")
    links = {"fast": "a fast link (a 16-bit copy of a stage's weights crosses it in one inner step)"}
    if home:
        here = "; ".join(f"{m}'s round {r['round_steps']:g} inner steps beside compute at utilisation "
                         f"{r['utilisation']:.2f}" for m, r in home["rounds_as_run_here"].items())
        peers = {r["peers"] for r in home["rounds_as_run_here"].values()}
        links["home"] = (
            f"the home link measured by bench.home_link ({home['rate_mbit']} Mbit/s: a 16-bit copy "
            f"takes {home['payload_steps']:g} inner steps; this project's overlapped, compressed "
            f"rounds among {', '.join(map(str, sorted(peers)))} volunteers: {here}; DiLoCo's "
            "round scaled to a grid's DP by the payloads it gathers)"
        )
    target = {r["grid"]: r["target_loss"] for r in _rows(result["rows"], "to_target")}
    lines = [
        "**Time to a target loss** (the highest final point of NoLoCo's and DiLoCo's validation-loss curves "
        "(random paths, the first validation batches) over the seeds, per grid: "
        + ", ".join(f"{g}: {t:.3f}" for g, t in target.items())
        + "), in inner steps of compute, from "
        "the steps each method needed here and the cost of a step on the link "
        "(bench/convergence/wallclock.py: the paper's latency model, log-normal message times std/mean 0.5; "
        "barrier idle left out, which favours DDP and DiLoCo):",
        "",
        "| link | grid | method | round | steps to target | cost per step | wall (steps of compute) | vs "
        "DiLoCo |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for link in links:
        for r in (w for w in walls if w["link"] == link):
            method = f"{r['method']} ({r['setting']})" if r.get("setting") else r["method"]
            lines.append(f"| {link} | {r['grid']} | {method} | {r['round'] or '-'} | {_num(r['steps'], 0)} | "
                         f"{r['step_cost']:.2f} | {_num(r['wall_steps'], 0)} | {_num(r['vs_diloco'], 2)} |")
    return ("\n".join(lines) + "\n\n" + "Links: " + "; ".join(f"{k}: {v}" for k, v in links.items()) + ".\n\n"
            + _wall_reading(walls, links))


def _wall_reading(walls: list[dict], links: dict) -> str:
    """NoLoCo's wall time to the target against DiLoCo's with the same kind of round, per link."""
    parts = []
    noloco = [w for w in walls if w["method"] == "noloco"]
    for link in links:
        for setting, round_kind in dict.fromkeys((w.get("setting", ""), w["round"]) for w in noloco
                                                 if w["link"] == link):
            ratios = [w["vs_diloco"] for w in noloco if w["link"] == link and w.get("setting", "") == setting
                      and w["round"] == round_kind and w["vs_diloco"] is not None]
            at = f", NoLoCo at {setting}" if setting else ""
            if ratios:
                parts.append(f"{link} link, {round_kind} round{at}: {_span(ratios)}")
    if not parts:
        return ""
    return (
        "NoLoCo's wall time to the target against DiLoCo's, both with the same kind of round (below 1: "
        "NoLoCo first): "
        + "; ".join(parts)
        + ". Where the ratio is above 1, NoLoCo's cheaper round does not "
        "make up for the extra steps it needs here; the 'as run here' rows cost both methods' rounds as this "
        "project's node runs them (overlapped, compressed, measured), where NoLoCo's moves one partner's "
        "payload and DiLoCo's every other peer's."
    )


def _span(ratios: list[float]) -> str:
    low, high = min(ratios), max(ratios)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def _checks(result: dict) -> str:
    c = result["summary"]["checks"]
    ddp, nd, grow, order = c["ddp_best"], c["noloco_le_diloco"], c["gaps_grow_with_dp"], c["scaling_order"]
    local = c.get("local_worst")
    best = ", ".join(f"{g}: {m}" for g, m in ddp["best_by_grid"].items())
    nd_grids = "; ".join(
        f"{g}: {v['diff_pct']:+.2f} %{_paired_range(v)} ({v['seeds_holding']} of {v['seeds']} "
        "seeds at or below)"
        for g, v in nd["by_grid"].items()
    )
    series = "; ".join(f"{name}: " + " -> ".join(f"{gap:+.2f} % (DP {dp})" for dp, gap in zip(v["dp"],
                                                                                              v["gap_pct"]))
                       for name, v in grow["series"].items())
    excess = " -> ".join(f"{e:+.2f} % (M {m})" for m, e in zip(order["m"], order["excess_pct"]))
    return "\n".join(
        [
            f"- DDP best in every grid: {_yes(ddp['holds'])} (lowest mean perplexity: {best}); every other "
            f"method behind DDP in every seed: {_yes(ddp['every_seed'])}.",
            *(
                [
                    f"- Local-only worst in every grid: {_yes(local['holds'])} (highest mean perplexity: "
                    + ", ".join(f"{g}: {m}" for g, m in local["worst_by_grid"].items())
                    + ")."
                ]
                if local
                else []
            ),
            f"- NoLoCo at or below DiLoCo in every grid: {_yes(nd['holds'])} (NoLoCo relative to DiLoCo: "
            f"{nd_grids}).",
            f"- Gaps to DDP grow with DP: {_yes(grow['holds'])} ({series}).",
            f"- DiLoCo's excess over DDP rises with M: {_yes(order['holds'])} ({excess}).",
        ]
    )


def _paired_range(check: dict) -> str:
    """The seed-by-seed differences' range, where the result has it."""
    if check.get("paired_min_pct") is None:
        return ""
    return f", per seed {check['paired_min_pct']:+.2f}..{check['paired_max_pct']:+.2f} %"


def _meaning(result: dict) -> str:
    s = result["summary"]
    held = [CHECK_TITLES[n] for n, c in s["checks"].items() if c["holds"]]
    failed = [CHECK_TITLES[n] for n, c in s["checks"].items() if not c["holds"]]
    if not failed:
        text = (
            "All checks hold: at equal tokens DDP is best, NoLoCo matches or beats DiLoCo, and the "
            "low-communication methods fall further behind as data parallelism grows, as in the paper's "
            "table and the scaling-law paper."
        )
    else:
        text = (f"The paper's shape is only partly reproduced. Holds: {', '.join(held) or 'nothing'}. "
                f"Does not hold: {', '.join(failed)}.")
        if not s["checks"]["noloco_le_diloco"]["holds"]:
            text += " " + _where_noloco_behind(s["checks"]["noloco_le_diloco"]) + " " + _why_noloco_behind(
                result["rows"]) + _gain_evidence(result)
    if result["mode"] == "quick":
        text += (
            f" This is the quick mode, sized for `make bench` ({s['steps']} steps per run): read it as a "
            "smoke test of the pipeline and run `--full` for the comparison with the paper."
        )
    return text + " " + _gaps_against_paper(result["rows"])


def _where_noloco_behind(check: dict) -> str:
    """In which grids NoLoCo trails DiLoCo, and whether every seed says so."""
    behind = {g: v for g, v in check["by_grid"].items() if v["diff_pct"] > 0}
    ahead = [g for g, v in check["by_grid"].items() if v["diff_pct"] <= 0]
    text = "NoLoCo trails DiLoCo in " + "; ".join(
        f"{g} ({v['diff_pct']:+.2f} %, "
        + (
            "in every seed)"
            if v["seeds_holding"] == 0
            else f"in {v['seeds'] - v['seeds_holding']} of {v['seeds']} "
            "seeds only, within the spread between seeds)"
        )
        for g, v in behind.items()
    )
    if ahead:
        text += " and is ahead in " + ", ".join(ahead)
    return text + "."


def _why_noloco_behind(rows: list[dict]) -> str:
    """The spread of NoLoCo's workers against DiLoCo's, and the consensus model's loss."""
    grids = {(r["grid"], r["method"]): r for r in _rows(rows, "grid")}
    parts = []
    for grid in dict.fromkeys(g for g, _ in grids):
        noloco, diloco = grids.get((grid, "noloco")), grids.get((grid, "diloco"))
        if noloco and diloco and noloco["ppl_mean"] > diloco["ppl_mean"]:
            parts.append(
                f"{grid}: weight spread {noloco['weight_std_mean']:.1e} against "
                f"{diloco['weight_std_mean']:.1e}, "
                f"consensus ppl {noloco['consensus_ppl_mean']:.3f} against {diloco['consensus_ppl_mean']:.3f}"
            )
    return (
        (
            "Why, measured: NoLoCo's workers of a stage end apart where DiLoCo's are equal after each "
            "all-worker step, and a random path crosses workers that disagree; the mean of NoLoCo's workers "
            "(consensus) is closer to DiLoCo (" + "; ".join(parts) + ")."
        )
        if parts
        else ""
    )


def _gain_evidence(result: dict) -> str:
    """The sweep read as one variable: the outer gain beta / (1 - alpha) that a steady
    Delta gets, against DiLoCo's, with the loss each gain reached."""
    sweep = [r for r in _rows(result["rows"], "sweep") if r.get("outer_gain") is not None]
    diloco = next((r for r in result["rows"] if r.get("section") == "grid" and r.get("method") == "diloco"),
                  None)
    if len(sweep) < 2 or diloco is None:
        return ""
    from bench.convergence.stats import outer_gain

    default = next(r for r in sweep if r["variant"] == "default")
    same_pull = sorted((r for r in sweep if r["outer_gamma"] == default["outer_gamma"]),
                       key=lambda r: (r["outer_gain"], r["first_seed_val_loss"]))
    best = min(sweep, key=lambda r: r["val_loss_mean"] if r["seeds"] > 1 else float("inf"))
    listed = "; ".join(f"{r['variant']}: gain {r['outer_gain']:.2f}, loss {r['first_seed_val_loss']:.4f}"
                       for r in same_pull)
    text = (
        f" Second, the outer step's gain: NoLoCo's Delta is the mean of a pair, not of all DP workers, so it "
        f"is noisier, and the paper's settings apply a steady Delta beta / (1 - alpha) = "
        f"{default['outer_gain']:.2f} "
        f"times per round against DiLoCo's {outer_gain(diloco):.2f}. In the sweep on {sweep[0]['grid']} "
        f"(first seed, gamma {default['outer_gamma']:g}) the loss rises with the gain: {listed}."
    )
    no_pull = next((r for r in sweep if r["outer_gamma"] == 0.0), None)
    if no_pull is not None:
        text += (
            f" Without the pull towards the pair's mean ({no_pull['variant']}) the workers drift apart "
            f"(weight spread {no_pull['weight_std_mean']:.1e} against {default['weight_std_mean']:.1e}) and "
            f"the loss is {no_pull['gap_to_default_pct']:+.2f} % off that at the paper's settings."
        )
    if best["gap_to_diloco_pct"] is not None:
        text += (f" With {best['variant']} (gain {best['outer_gain']:.2f}) NoLoCo trails DiLoCo by "
                 f"{best['gap_to_diloco_pct']:+.2f} % in eval loss ({best['gap_to_diloco_min_pct']:+.2f}.."
                 f"{best['gap_to_diloco_max_pct']:+.2f} over {best['seeds']} seeds) instead of "
                 f"{default['gap_to_diloco_pct']:+.2f} % at the "
                 "paper's settings: most of the gap is their gain, the rest the pair's noisier Delta and the "
                 "spread between workers.")
    return text


def _gaps_against_paper(rows: list[dict]) -> str:
    pairs = [(r["gap_to_ddp_pct"], r["paper_gap_pct"]) for r in rows
             if r["kind"] == "grid" and r["method"] in ("noloco",
                                                        "diloco") and r["paper_gap_pct"] is not None]
    text = (
        "Absolute perplexities are not comparable with the paper's (byte tokens of a small corpus and a tiny "
        "model against BPE tokens of C4 and 125M parameters); compare the gaps to DDP in %."
    )
    if pairs:
        ours, paper = [p[0] for p in pairs], [p[1] for p in pairs]
        text += (f" NoLoCo's and DiLoCo's gaps here span {min(ours):+.1f} % to {max(ours):+.1f} %, "
                 f"the paper's in the same grids {min(paper):+.1f} % to {max(paper):+.1f} %.")
    return text


def _ddp_note(rows: list[dict]) -> str:
    ddp = [r for r in rows if r["kind"] == "grid" and r["method"] == "ddp"]
    values = ", ".join(f"{r['ppl_mean']:.3f} ({r['grid']})" for r in ddp)
    return (
        "DDP is the same computation in every grid (the same global batch, averaged gradients) except that "
        "each stage clips its own gradient norm, so PP = 1 and PP = 2 clip differently; its perplexity: "
        f"{values}. Each grid's gaps are measured against its own DDP."
    )


def markdown(result: dict) -> str:
    grids = list(dict.fromkeys(r["grid"] for r in result["rows"] if r["kind"] == "grid"))
    parts = [
        "## convergence: NoLoCo vs DiLoCo vs DDP vs local at equal tokens",
        f"{result['mode'].capitalize()} run, {result['wall_s']:.0f} s on {result['machine']['cpu_count']} "
        f"CPUs:",
        f"```bash\n{rerun_command(NAME, result['mode'])}\n```",
        _setup(result),
        "![convergence](bench/results/convergence.png)",
        *(_grid_table(result["rows"], g) for g in grids),
        _scaling_table(result),
        _sweep_table(result),
        _wire_table(result),
        _wall_table(result),
        "**Does it reproduce the paper's shape?**",
        _checks(result),
        _meaning(result),
        _ddp_note(result["rows"]),
    ]
    if result["notes"]:
        parts.append("\n".join(f"- {n}" for n in result["notes"]))
    return "\n\n".join(p for p in parts if p) + "\n"

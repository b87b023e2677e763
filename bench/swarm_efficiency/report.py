"""The swarm-efficiency benchmark's page and plot, from its result alone."""

from __future__ import annotations

from pathlib import Path

from bench.common.results import pyplot, rerun_command
from bench.swarm_efficiency.swarm import COMPUTE_COLUMNS, MACHINE_COLUMNS

NAME = "swarm_efficiency"


MACHINE_LABELS = {"useful": "useful compute", "recompute": "recompute", "serialisation": "(de)serialisation",
                  "outer": "outer rounds", "other": "other compute", "event_loops": "event loops",
                  "dht": "DHT processes", "p2pd": "p2pd daemons", "driver": "driver + bootstrap",
                  "other_processes": "other processes", "idle": "idle"}
STAGE_LABELS = {**{c: MACHINE_LABELS[c] for c in COMPUTE_COLUMNS}, "wait_for_core": "waiting for a core",
                "idle": "idle (peers, pipeline, rounds, GIL)"}


def _rows(result: dict, table: str) -> list[dict]:
    return [row for row in result["rows"] if row.get("table") == table]


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (bars, machine, stages) = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1, 1.3,
                                                                                                       1.3]})
    throughput = _rows(result, "throughput")
    names = [row["layout"] for row in throughput]
    values = [row["tokens_per_s"] for row in throughput]
    drawn = bars.bar(names, values, color=["0.55" if n.startswith("plain") else "tab:blue" for n in names])
    bars.bar_label(drawn,
                   labels=[f"{row['ratio']:.2f}x\n{_f2(row.get('cpu_ratio'))}x/CPU-s" for row in throughput],
                   fontsize=8)
    bars.set_ylabel("tokens/s (steady state)")
    bars.set_title("tokens/s; labels: ratio to plain, per s and per CPU-s", fontsize=10)
    bars.margins(y=0.15)
    bars.tick_params(axis="x", labelrotation=20)
    _stacked(machine, _rows(result, "machine"), MACHINE_LABELS, "share of the machine's CPU time")
    stage_rows = _rows(result, "stages")
    for row in stage_rows:
        row["label"] = f"{row['layout']} stage {row['stage']}"
    _stacked(stages, stage_rows, STAGE_LABELS, "share of a node's compute thread (wall time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stacked(ax, rows: list[dict], labels: dict[str, str], title: str) -> None:
    from matplotlib import colormaps

    colors = {column: colormaps["tab20"](i) for i, column in enumerate(dict.fromkeys([*MACHINE_LABELS,
                                                                                      *STAGE_LABELS]))}
    names = [row.get("label", row["layout"]) for row in rows]
    left = [0.0] * len(rows)
    for column, label in labels.items():
        widths = [row.get(column, 0.0) for row in rows]
        ax.barh(names, widths, left=left, label=label, color=colors[column])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    """Markdown table lines; ``columns`` = (key, header, format: "pct", "int", "f2", "f3" or "s")."""
    formats = {"pct": _pct, "int": lambda v: f"{v:,.0f}", "f2": lambda v: f"{v:.2f}",
               "f3": lambda v: f"{v:.3f}",
               "s": str}
    lines = ["| " + " | ".join(header for _, header, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = ["" if row.get(key) is None else formats[fmt](row[key]) for key, _, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict) -> str:
    s = result["summary"]
    parts = ["## Swarm efficiency: a local swarm against plain training", "", _intro(s), "",
             f"```\n{rerun_command(NAME, result['mode'])}\n```", "",
             f"![swarm efficiency](bench/results/{NAME}.png)", "",
             *_tables(result), "", _meaning(result)]
    if _rows(result, "fast_link"):
        parts += ["", *fast_link_section(result)]
    if result.get("notes"):
        parts += ["", *[f"- {note}" for note in result["notes"]]]
    return "\n".join(parts) + "\n"


def _intro(s: dict) -> str:
    layouts = "; ".join(
        f"**{name}: {s['ratio'][name]:.2f}x** plain's tokens/s ({s['tokens_per_s'][name]:,.0f}), "
        f"{_f2(s['cpu_ratio'][name])}x its tokens per CPU-second, {s['ratio_cores'][name]:.2f}x "
        f"plain with {s['cores']} threads"
        for name in s["ratio"]
    )
    return (
        f"Model `{s['model']}` ({s['num_parameters']:,} parameters), sequence length {s['seq_len']}, "
        f"{s['batch_size']} sequences per micro-batch and per inner step, NoLoCo with H = "
        f"{s['inner_steps']}, the "
        f"bundled corpus. Plain training: the whole model in one process with {s['plain_threads']} torch "
        f"threads (what the swarm's nodes have together: `swarm-node local` gives each one), "
        f"{s['tokens_per_s_plain']:,.0f} tokens/s ({s['tokens_per_s_plain_cores']:,.0f} with one thread per "
        f"core, {s['cores']} cores). Swarm in steady state (stage-0 inner steps {s['window_steps'][0]} to "
        f"{s['window_steps'][1]}): {layouts}."
    )


def _f2(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _tables(result: dict) -> list[str]:
    s = result["summary"]
    return [
        "Throughput in the steady window (`whole run`: `tokens_per_s` of the `swarm-node local` summary, "
        "start-up and final evaluation included; tokens per CPU-second count the CPU time of all the run's "
        "processes; step time: between consecutive inner steps, intervals holding an outer round left out; "
        "outer round: mean time from a node's round start (seeking a partner) to its outer step, in the "
        "window; outer rounds (with a partner) over the whole run; `others`: share of the machine other "
        "processes used meanwhile):",
        "",
        *_table(
            _rows(result, "throughput"),
            [
                ("layout", "layout", "s"),
                ("processes", "processes", "int"),
                ("torch_threads", "torch threads", "int"),
                ("tokens_per_s", "tokens/s", "int"),
                ("ratio", "ratio to plain", "f2"),
                ("ratio_cores", "ratio to plain, 1 thread/core", "f2"),
                ("tokens_per_cpu_s", "tokens per CPU-s", "int"),
                ("cpu_ratio", "ratio per CPU-s", "f2"),
                ("tokens_per_s_whole_run", "tokens/s whole run", "int"),
                ("step_time_mean_s", "step time mean (s)", "f3"),
                ("step_time_std_s", "step time std (s)", "f3"),
                ("round_time_mean_s", "outer round (s)", "f2"),
                ("outer_rounds", "outer rounds", "int"),
                ("rounds_with_partner", "with partner", "int"),
                ("microbatches_lost", "micro-batches lost", "int"),
                ("other_processes", "others", "pct"),
            ],
        ),
        "",
        "Where the machine's CPU time goes in the steady window (all cores together; the compute buckets "
        "split each node's compute-thread CPU time, read from /proc, by that thread's cProfile):",
        "",
        *_table(
            _rows(result, "machine"),
            [("layout", "layout", "s"), *[(c, MACHINE_LABELS[c], "pct") for c in MACHINE_COLUMNS]],
        ),
        "",
        "Per stage: one node's compute thread over the window (mean over the stage's nodes; runnable but "
        "without a core is `waiting for a core`, blocked is `idle`), and the CPU its other threads and "
        "processes use, in cores:",
        "",
        *_table(
            _rows(result, "stages"),
            [
                ("layout", "layout", "s"),
                ("stage", "stage", "int"),
                *[(c, STAGE_LABELS[c], "pct") for c in STAGE_LABELS],
                ("event_loop_cores", "event loop", "f2"),
                ("dht_cores", "DHT process", "f2"),
                ("p2pd_cores", "p2pd", "f2"),
            ],
        ),
        "",
        "p2pd's share of the swarm's own CPU time: "
        + ", ".join(f"{name} {_pct(v)}" for name, v in s["daemon_cpu_share"].items())
        + f". Inner-step time of the {s['step_time_s']['layout']} swarm's nodes (`summary.step_time_s`, read "
          f"by the "
        f"latency-model benchmark): mean {s['step_time_s']['mean']:.3f} s, std {s['step_time_s']['std']:.3f} "
        f"s over {s['step_time_s']['n']} steps.",
    ]


def _meaning(result: dict) -> str:
    s = result["summary"]
    machine = {row["layout"]: row for row in _rows(result, "machine")}
    plain_useful = next(row["useful"] for name, row in machine.items() if name.startswith("plain"))
    idle = {}
    for row in _rows(result, "stages"):
        idle.setdefault(row["layout"], []).append(row["idle"])
    sentences = []
    for name, ratio in s["ratio"].items():
        m = machine[name]
        network = m["event_loops"] + m["dht"] + m["p2pd"] + m["driver"]
        verdict = "falls short of plain training by" if ratio < 1 else "beats plain training by"
        sentences.append(
            f"The {name} swarm {verdict} {_pct(abs(1 - ratio))} in tokens/s ({_f2(s['cpu_ratio'][name])}x "
            f"per CPU-second). Useful compute, the work plain training also does, gets {_pct(m['useful'])} "
            f"of the machine against {_pct(plain_useful)} in plain training; the rest goes to recomputation "
            f"({_pct(m['recompute'])}), (de)serialisation ({_pct(m['serialisation'])}), outer rounds "
            f"({_pct(m['outer'])}), the networking stack (event loops, DHT processes, p2pd, driver: "
            f"{_pct(network)}, p2pd alone {_pct(m['p2pd'])}) and idle cores ({_pct(m['idle'])}); a compute "
            f"thread is blocked (waiting for peers, the pipeline, a round partner, or the GIL) "
            f"{_pct(sum(idle[name]) / len(idle[name]))} of the time on average."
        )
    for row in _rows(result, "throughput"):
        if row.get("outer_rounds") and row["rounds_with_partner"] < row["outer_rounds"]:
            sentences.append(
                f"In {row['layout']} only {row['rounds_with_partner']} of {row['outer_rounds']} outer rounds "
                f"found a partner: a node seeks one for up to {s['round_timeout_s']:.0f} s before its "
                f"local-only step, and rounds took {_f2(row['round_time_mean_s'])} s on average, during "
                f"which its stage does not train."
            )
    sentences.append(
        "Recomputation is the price of the pipeline without stored activations (each non-last stage runs its "
        "forward twice, about a third of its useful work); the one-stage layout has none and pays only for "
        "outer rounds and a networking stack per process, which on a machine this small competes with "
        "compute for the same cores."
    )
    if s["other_processes_max"] > 0.05:
        sentences.append(
            f"Other processes used up to {_pct(s['other_processes_max'])} of the machine during these "
            f"measurements: tokens/s ratios then also depend on how the scheduler shared the cores between "
            f"one plain process and the swarm's many, while the ratio per CPU-second does not; rerun on an "
            f"idle machine for clean tokens/s."
        )
        if s["tokens_per_s_plain_cores"] < 0.5 * s["tokens_per_s_plain"]:
            sentences.append(
                f"Plain training with {s['cores']} threads suffers most from that load: with as many threads "
                f"as cores, libgomp spin-waits at its barriers while the other thread is descheduled (with "
                f"{s['plain_threads']} threads it sees the oversubscription and spins briefly; "
                "`OMP_WAIT_POLICY=PASSIVE` also avoids it)."
            )
    return "What it means: " + " ".join(sentences)


def fast_link_section(result: dict) -> list[str]:
    f = result["summary"]["fast_link"]
    before, after = f["transport_share"]["libp2p streams"], f["transport_share"]["direct lanes"]
    return [
        "### Fast link: libp2p streams against direct lanes",
        "",
        f"A 2 x 2 swarm of the `{f['model']}` model, {f['batch_size']} x {f['seq_len']} tokens a "
        f"micro-batch, on loopback: the least compute per byte sent the CPU presets allow, still far more "
        f"than a GPU's, so the bytes stay a few MB/s (bench/swarm_efficiency/fast_link.py). Transport: the "
        f"p2pd daemons and the nodes' threads other than compute (event loops, lanes, the wire thread), as a "
        f"share of all the cores' time in the steady window; MB/s: every byte the nodes sent over the whole "
        f"run. Each path ran {f.get('runs_each', 1)} times, the two taking turns (A B B A); a row is the "
        f"mean of its runs, micro-batches lost their sum.",
        "",
        *_table(
            _rows(result, "fast_link"),
            [
                ("path", "bulk bytes over", "s"),
                ("tokens_per_s", "tokens/s", "int"),
                ("transport_share", "transport", "pct"),
                ("p2pd_share", "of it p2pd", "pct"),
                ("node_io_share", "of it the nodes' I/O threads", "pct"),
                ("compute_share", "compute threads", "pct"),
                ("idle_share", "idle cores", "pct"),
                ("stage0_blocked", "stage 0 blocked", "pct"),
                ("mb_per_s_whole_run", "MB/s sent", "f2"),
                ("step_time_mean_s", "step time (s)", "f3"),
                ("microbatches_lost", "micro-batches lost", "int"),
                ("other_processes", "others", "pct"),
            ],
        ),
        "",
        f"Direct lanes: {f['speedup']:.2f}x the tokens/s of libp2p streams{_within(result)}; transport's "
        f"share of the machine {100 * before:.0f} % before, {100 * after:.0f} % after.",
    ]


def _within(result: dict) -> str:
    """How far one path's own runs lie apart: a speedup inside it is the machine, not the path."""
    spreads = [(max(each) - min(each)) / min(each) for r in _rows(result, "fast_link")
               if len(each := r.get("tokens_per_s_each", [])) > 1]
    return f" (one path's runs differ by up to {100 * max(spreads):.0f} % between them)" if spreads else ""

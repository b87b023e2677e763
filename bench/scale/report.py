"""The scale benchmark's plot and BENCHMARKS.md section, from the result JSON alone."""

from __future__ import annotations

from pathlib import Path

from bench.common.results import load, pyplot, rerun_command

NAME = "scale"
LABELS = ("noloco", "one-key registry", "diloco")
COLOURS = {"noloco": "#2e8b57", "one-key registry": "#8c8c8c", "diloco": "#c0642f"}
# The bar at N = 1024: share of rounds with a partner, median time to a partner
# in round trips, control traffic per peer.
TARGET_PARTNER_SHARE, TARGET_RTTS, TARGET_CONTROL_KB_S = 0.95, 3.0, 10.0


def _runs(rows: list[dict], label: str) -> list[dict]:
    return sorted((r for r in rows if r.get("kind") == "run" and r["label"] == label),
                  key=lambda r: r["peers_per_stage"])


def _kb_s(per_min: float) -> float:
    return per_min / 60e3


def plot(rows: list[dict], out_dir: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label in LABELS:
        runs = _runs(rows, label)
        if not runs:
            continue
        n = [r["peers_per_stage"] for r in runs]
        style = dict(color=COLOURS[label], marker="o", label=label)
        axes[0].plot(n, [r["partner_share"] for r in runs], **style)
        axes[1].plot(n, [_kb_s(r["control_bytes_per_peer_min_median"]) for r in runs], **style)
        axes[1].plot(n, [_kb_s(r["control_bytes_per_peer_min_max"]) for r in runs], color=COLOURS[label],
                     linestyle=":", marker="x", label=f"{label}, busiest peer")
        if label != "diloco":
            axes[2].plot(n, [r["to_partner_median_s"] or float("nan") for r in runs], **style)
            axes[2].plot(n, [r["to_partner_p99_s"] or float("nan") for r in runs], color=COLOURS[label],
                         linestyle=":", marker="x", label=f"{label}, p99")
    axes[1].axhline(TARGET_CONTROL_KB_S, color="black", linewidth=0.8, linestyle="--", label="10 kB/s")
    titles = ("rounds with a partner (live peers)", "control traffic per peer (kB/s)",
              "boundary to partner (s)")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peers per stage")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out_dir / f"{NAME}.png", dpi=110)
    plt.close(fig)


def _num(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(rows: list[dict]) -> str:
    lines = [
        "| registry, method | peers a stage | shards | rounds | with a partner | proposals / round | "
        "refusals / round | to a partner: median, p99 (s) | median (round trips) | idle / round (s) | "
        "control kB/s a peer: median, p99, max | forwards to dead / unreachable / lost | crashes, joins | "
        "real s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in LABELS:
        for r in _runs(rows, label):
            lines.append(
                f"| {label} | {r['peers_per_stage']} | {r['registry_shards']} | {r['rounds']} | "
                f"{r['partner_share']:.3f} | {r['proposals_per_round']:.2f} | {r['refusals_per_round']:.2f} "
                f"| {_num(r['to_partner_median_s'])}, {_num(r['to_partner_p99_s'])} | "
                f"{_num(r['to_partner_median_rtts'], 1)} | {r['idle_per_round_s']:.2f} | "
                f"{_kb_s(r['control_bytes_per_peer_min_median']):.1f}, "
                f"{_kb_s(r['control_bytes_per_peer_min_p99']):.1f}, "
                f"{_kb_s(r['control_bytes_per_peer_min_max']):.1f} | {100 * r['forwards_to_dead_share']:.2f} "
                f"% / {100 * r['forwards_to_unreachable_share']:.2f} % / "
                f"{100 * r['forwards_lost_share']:.2f} % | {r['crashes']}, {r['joins']} | {r['real_s']:.0f} |"
            )
    return "\n".join(lines)


def _by_kind(rows: list[dict]) -> str:
    runs = _runs(rows, "noloco")
    kinds = sorted({k for r in runs for k in r["control_by_kind_per_peer_min"]})
    ops = ("gets", "entries_read", "stores")
    lines = ["Control traffic by kind, NoLoCo, kB/s a peer (mean over peers), and the registry operations "
             "behind the DHT's share, a minute a peer:", "",
             "| peers a stage | " + " | ".join(kinds) + " | registry gets | entries read | stores |",
             "|---|" + "---|" * (len(kinds) + len(ops))]
    for r in runs:
        registry = r.get("registry_ops_per_peer_min", {})
        lines.append(
            f"| {r['peers_per_stage']} | "
            + " | ".join(f"{_kb_s(r['control_by_kind_per_peer_min'].get(k, 0.0)):.2f}" for k in kinds)
            + " | "
            + " | ".join(f"{registry[k]:.1f}" if k in registry else "-" for k in ops)
            + " |"
        )
    return "\n".join(lines)


def _verdict(rows: list[dict]) -> str:
    runs = _runs(rows, "noloco")
    if not runs:
        return ""
    top = runs[-1]
    holds = {
        "rounds with a partner >= 95 %": top["partner_share"] >= TARGET_PARTNER_SHARE,
        "median time to a partner < 3 round trips": (top["to_partner_median_rtts"] or 1e9) < TARGET_RTTS,
        "control traffic < 10 kB/s for every peer": _kb_s(top["control_bytes_per_peer_min_max"])
        < TARGET_CONTROL_KB_S,
    }
    marks = "; ".join(f"{k}: **{'yes' if v else 'no'}**" for k, v in holds.items())
    return f"At N = {top['peers_per_stage']} a stage: {marks}."


def _processes(result: dict | None) -> str:
    """The real node processes next to the simulator at the same size (bench/scale/processes.py)."""
    if result is None:
        return ""
    rows = result["rows"]
    real = next(r for r in rows if r["kind"] == "real")
    memory = [r for r in rows if r["kind"] == "memory"]
    s = result["summary"]
    ops = ("gets", "entries_read", "stores")

    def mean(runs: list[dict], key: str) -> float:
        return sum(r[key] for r in runs) / len(runs)

    table = [
        "| | links | rounds | with a partner | proposals / round | refusals / round | "
        "registry gets / min a peer | entries read / min | stores / min |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| real processes | loopback, 2 cores shared: a proposal answered in {real['proposal_s_mean']:.2f} "
        f"s, a DHT get {real['dht_get_s_mean']:.2f} s, a store {real['dht_store_s_mean']:.2f} s | "
        f"{real['rounds_in_window']} | {real['partner_share']:.3f} | {real['proposals_per_round']:.2f} | "
        f"{real['refusals_per_round']:.2f} | "
        + " | ".join(f"{real['registry_ops_per_peer_min'][k]:.1f}" for k in ops)
        + " |",
    ]
    verdicts = []
    for links in ("loopback", "calibrated"):
        sims = [r for r in rows if r["kind"] == "simulated" and r.get("links", "loopback") == links]
        if not sims:
            continue
        how = ("round trips 0.1-1 ms, DHT ops of a lookup's round trips" if links == "loopback" else
               f"round trips {sims[0]['rtt_ms']:.0f} ms, a DHT get {sims[0]['dht_get_s']:.2f} s and a store "
               f"{sims[0]['dht_store_s']:.2f} s (mean)")
        table.append(
            f"| simulator, mean of {len(sims)} seeds | {links}: {how} | {mean(sims, 'rounds'):.0f} | "
            f"{mean(sims, 'partner_share'):.3f} | {mean(sims, 'proposals_per_round'):.2f} | "
            f"{mean(sims, 'refusals_per_round'):.2f} | "
            + " | ".join(
                f"{sum(r['registry_ops_per_peer_min'][k] for r in sims) / len(sims):.1f}" for k in ops
            )
            + " |"
        )
        v = s.get(links)
        if v:
            verdicts.append(
                f"{links} links: rounds with a partner {100 * v['partner_share']['simulated']:.1f} % "
                f"simulated against {100 * v['partner_share']['real']:.1f} % real "
                f"({v['partner_share']['points_apart']} points apart; the bar is 5), proposals per round "
                f"{v['proposals_per_round']['simulated']} against {v['proposals_per_round']['real']} "
                f"(x{v['proposals_per_round']['ratio']}; the bar is 0.7-1.3)"
            )
    lines = [
        f"**{real['nodes']} real node processes** on this machine (`{result['command']}`, "
        f"{result['wall_s']:.0f} s): `swarm-node local`, {real['stages']} stages x {real['peers_per_stage']} "
        f"nodes, the debug model, one torch thread each, H = {real['inner_steps']}, the registry in "
        f"{real.get('registry_shards', '?')} shards a stage; beside it the simulator with the same shape "
        f"(the inner-step time the nodes measured, {real['step_s_median']:.2f} s, and how far apart the "
        f"nodes' speeds were"
        + (f", log-normal sigma {real['step_s_log_sigma']:.2f}" if "step_s_log_sigma" in real else "")
        + (
            f"; the outer round's compute: {real['round_prepare_s_mean']:.2f} s at the boundary, "
            f"{max(0.0, real['round_exchange_s_mean'] - real['proposal_s_mean']):.2f} s to check the "
            f"partner's payload, {real['round_close_s_mean']:.2f} s for the outer step, which leave a node "
            f"busy for proposals ({100 * real['refused_busy_share']:.0f} % of the real refusals)"
            if "round_prepare_s_mean" in real
            else ""
        )
        + "; the debug model's payloads; no churn), on loopback links and on links "
        "calibrated to what the real run measured. Rounds 0 and 1 are left out of both, as the simulator's "
        "warm-up.",
        "",
        *table,
        "",
        "; ".join(verdicts) + f". Micro-batches lost: {real['microbatches_lost']}.",
        "",
        "Memory per process kind (PSS, so pages a forked DHT child shares with its node count once; sampled "
        "every 5 s):",
        "",
        "| process | how many | PSS median (MB) | PSS max (MB) |",
        "|---|---|---|---|",
        *(
            f"| {m['process']} | {m['count']} | {m['pss_mb_median']:.0f} | {m['pss_mb_max']:.0f} |"
            for m in memory
        ),
    ]
    if result.get("notes"):
        lines += ["", *(f"- {n}" for n in result["notes"])]
    return "\n".join(lines)


def _against_latency_model(rows: list[dict], model: dict | None) -> str:
    """The simulated rounds beside the NoLoCo paper's latency model (bench.latency_model)."""
    noloco = sorted((r for r in rows if r.get("label") == "noloco"), key=lambda r: r["peers_per_stage"])
    barrier = sorted((r for r in rows if r.get("label") == "diloco"), key=lambda r: r["peers_per_stage"])
    if not noloco:
        return ""
    rtts = [r["to_partner_median_rtts"] for r in noloco if r.get("to_partner_median_rtts")]
    rounds = [r["round_median_s"] for r in noloco]
    def span(values: list[float], digits: int) -> str:
        low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
        return low if low == high else f"{low}-{high}"

    text = (
        f"Against the latency model of the NoLoCo paper (section 5.3, bench.latency_model): a NoLoCo round "
        f"waits for one pair exchange, and here the median time from a round's end to a partner is "
        f"{span(rtts, 1) if rtts else '-'} round trips and the median round {span(rounds, 2)} s from "
        f"{noloco[0]['peers_per_stage']} to {noloco[-1]['peers_per_stage']} peers a stage: it does not grow "
        f"with N"
    )
    ratios = (model or {}).get("summary", {}).get("allreduce_ratio_at_1024", {})
    if ratios:
        text += (", where the model's tree all-reduce costs "
                 + ", ".join(f"{v:.0f}x a pair ({k.split(', ')[1]})"
                             for k, v in ratios.items()) + " at N = 1024")
    if barrier:
        sizes = {b["peers_per_stage"] for b in barrier}
        text += (". The barrier baseline here (DiLoCo's group round, every peer of the stage) took "
                 + ", ".join(f"{r['round_median_s']:.1f} s at N = {r['peers_per_stage']}" for r in barrier)
                 + " a round (the round time-out caps it), against NoLoCo's "
                 + ", ".join(f"{r['round_median_s']:.1f} s" for r in noloco if r["peers_per_stage"] in sizes))
    return text + "."


def markdown(result: dict) -> str:
    rows = result["rows"]
    s = result["summary"]
    parts = [
        "## scale: hundreds of peers a stage on the swarm-scale simulator",
        f"{result['mode'].capitalize()} run, {result['wall_s']:.0f} s on {result['machine']['cpu_count']} "
        f"CPUs:",
        f"```bash\n{rerun_command(NAME, result['mode'])}\n```",
        f"The node's own Membership, PeerGuard, OuterExchange (PairingCoordinator, GroupRound for DiLoCo, "
        f"the partner checks), RoundGate and PeerChooser for every peer, on a virtual clock, around a "
        f"model-free stage (the real outer-round code on 32 weights) and a modelled network "
        f"(swarm_node/scale/network.py says what is modelled and how). {s['duration_s']:.0f} virtual seconds "
        f"a run, figures after two rounds of warm-up; scenario: {s['scenario']}.",
        "![scale](bench/results/scale.png)",
        _table(rows),
        _by_kind(rows),
        _verdict(rows),
        _against_latency_model(rows, load("latency_model")),
        _processes(load("scale_processes")),
    ]
    if result["notes"]:
        parts.append("\n".join(f"- {n}" for n in result["notes"]))
    return "\n\n".join(p for p in parts if p) + "\n"

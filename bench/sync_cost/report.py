"""The sync-cost benchmark's plot and its BENCHMARKS.md section, drawn only from the
result JSON (see bench/sync_cost/benchmark.py for the keys)."""

from __future__ import annotations

import math
import statistics

from bench.common.results import pyplot, rerun_command


def _size(params: int) -> str:
    return f"{params / 1e6:g}M"


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])


METHODS = ("pair", "pair_matched", "allreduce")


def _rounds(result: dict) -> dict[tuple, dict]:
    """Round rows by (setting, params, peers, method, with stragglers)."""
    return {(r["setting"], r["params"], r["peers"], r["method"], r["stragglers"] > 0): r
            for r in result["rows"] if r["table"] == "round"}


def _configs(rounds: dict[tuple, dict]) -> list[tuple]:
    """(setting, params, peers) in the order they were measured."""
    return list(dict.fromkeys(key[:3] for key in rounds))


def _setting_label(result: dict, setting: str) -> str:
    rate = next(r["rate_mbit"] for r in result["rows"] if r["setting"] == setting)
    return "loopback" if not rate else f"tbf {rate:g} Mbit/s"


# -- tables -------------------------------------------------------------------------------
def message_table(result: dict) -> str:
    lines = [[_setting_label(result, r["setting"]), _size(r["params"]), f"{r['frame_bytes'] / 1e6:.1f}",
              _num(r["message_s"], 3), f"{r['mbit_per_s']:.0f}"]
             for r in result["rows"] if r["table"] == "message"]
    return _table(["setting", "params", "frame MB (fp16 phi+Delta)", "message s", "payload Mbit/s"], lines)


def _round_cell(row: dict) -> str:
    if row["round_s"] is None:
        return "failed"
    return _num(row["round_s"]) + (f" ({row['failed']} failed)" if row["failed"] else "")


def round_table(result: dict) -> str:
    rounds, lines = _rounds(result), []
    for config in _configs(rounds):
        pair, matched, allr = (rounds.get((*config, method, False)) for method in METHODS)
        if not (pair and matched and allr):
            continue
        lines.append([_setting_label(result, config[0]), _size(config[1]), str(config[2]), _round_cell(pair),
                      _num(pair.get("attempts"), 1), _round_cell(matched), _num(matched.get("exchange_s")),
                      _round_cell(allr), _num(allr.get("matchmaking_s")),
                      _num(_ratio(allr["round_s"], pair["round_s"])),
                      _num(_ratio(allr["round_s"], matched["round_s"]))])
    return _table(["setting", "params", "N", "pair s", "requests/peer", "matched pair s", "one exchange s",
                   "all-reduce s", "matchmaking s (hidden)", "all-reduce / pair",
                   "all-reduce / matched pair"], lines)


def straggler_table(result: dict) -> str:
    rounds, lines = _rounds(result), []
    for config in _configs(rounds):
        for method in METHODS:
            row = rounds.get((*config, method, True))
            if row is None:
                continue
            lines.append([_setting_label(result, config[0]), _size(config[1]), str(config[2]), method,
                          f"{row['stragglers']} x {row['delay_s']:g} s", _round_cell(row),
                          _num(row["mean_idle_s"]), _num(row["max_idle_s"]),
                          row["idle_by_peer_s"] or "failed"])
    return _table(["setting", "params", "N", "method", "stragglers x delay", "round s", "mean idle s",
                   "max idle s",
                   "idle by peer s"], lines)


# -- what it means (every number from the result) ------------------------------------------
def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _ratios(rounds: dict[tuple, dict], method: str, slowed: bool, key: str) -> dict[tuple, float]:
    """All-reduce over ``method`` for ``key``, per (setting, params, N) where both ran."""
    out = {}
    for config in _configs(rounds):
        other, allr = rounds.get((*config, method, slowed)), rounds.get((*config, "allreduce", slowed))
        ratio = _ratio(allr and allr.get(key), other and other.get(key))
        if ratio is not None:
            out[config] = ratio
    return out


def _where(result: dict, config: tuple) -> str:
    setting, params, peers = config
    return f"{_setting_label(result, setting)}, {_size(params)}, N = {peers}"


def _span(ratios: dict[tuple, float]) -> str:
    return f"{min(ratios.values()):.2f}x to {max(ratios.values()):.2f}x"


def speed_paragraph(result: dict, rounds: dict[tuple, dict]) -> str:
    matched, node = _ratios(rounds, "pair_matched", False, "round_s"), _ratios(rounds, "pair", False,
                                                                               "round_s")
    if not matched:
        return "No configuration completed both a matched pair round and an all-reduce."
    largest = max(c[2] for c in matched)
    at_largest = {c: r for c, r in matched.items() if c[2] == largest}
    model = math.log2(largest)
    text = (
        f"**Without stragglers** the all-reduce's critical path was {_span(matched)} a matched pair round's "
        f"over {len(matched)} configurations (at N = {largest}: "
        + "; ".join(f"{_where(result, c)}: {r:.2f}x" for c, r in at_largest.items())
        + f"). The paper's latency model (2t log2 N against 2t) expects {model:.0f}x at N = {largest}"
    )
    if max(at_largest.values()) < model:
        text += (
            "; the measured gap is smaller. hivemind's all-reduce is a butterfly, not a tree: each peer "
            "sends and receives about 2(N-1)/N payloads, in parallel, so on links without latency (no netem "
            "here) its cost grows with N through bytes and CPU per peer, not through log2 N message latencies"
        )
    text += "."
    faster = [c for c, r in matched.items() if r < 1]
    if faster:
        text += (
            " The all-reduce beat a matched pair in "
            + "; ".join(_where(result, c) for c in faster)
            + ": with "
            "few peers it moves about the same bytes per peer (one payload each way at N = 2) but sends "
            "while it receives and pipelines its parts, while the node's exchange encodes, sends, decodes "
            "and checks the request in one piece, then does the same for the answer."
        )
    if node:
        slower = [c for c, r in node.items() if r < 1]
        text += f" Against the node's own pairing (`pair`) the all-reduce took {_span(node)} the time"
        text += (f"; it was faster in {len(slower)} of {len(node)} configurations." if slower else ".")
    return text


def protocol_paragraph(result: dict, rounds: dict[tuple, dict]) -> str:
    node = [r for key, r in rounds.items() if key[3] == "pair" and not key[4] and r["round_s"] is not None]
    matched = {key[:3]: r for key, r in rounds.items() if key[3] == "pair_matched" and not key[4]}
    if not node:
        return ""
    attempts = statistics.fmean(r["attempts"] for r in node)
    overhead = [_ratio(r["round_s"], matched[key[:3]]["round_s"]) for key, r in rounds.items()
                if key[3] == "pair" and not key[4] and key[:3] in matched]
    overhead = [o for o in overhead if o is not None]
    text = f"**The node's pairing.** Peers sent {attempts:.1f} proposals each per round on average"
    if overhead:
        text += (
            f", and a round took {_span({i: o for i, o in enumerate(overhead)})} a matched pair round's time"
        )
    text += (
        ". A proposal is a few bytes and only an accepted one is followed by the payload, so a refusal costs "
        "one round trip; two peers that propose to each other at once pair at once (the larger peer id "
        "accepts)"
    )
    if attempts > 1.05:
        text += (
            "; the other refusals (`busy` from a peer already reserved or proposing elsewhere, `not-ready`) "
            "are followed by a random back-off of 0.05-0.3 s"
        )
    messages = {(r["setting"],
                 r["params"]): r["message_s"] for r in result["rows"] if r["table"] == "message"}
    per_message = [_ratio(r["exchange_s"], messages.get(key[:2])) for key, r in matched.items()
                   if r.get("exchange_s") and messages.get(key[:2])]
    if per_message:
        text += f". One exchange took {statistics.median(per_message):.1f} message times (median)"
        if statistics.median(per_message) > 1.5:
            text += ": the request and the answer cross one after the other, not at once"
    computes = [
        r["compute_s"] / r["round_s"] for r in matched.values() if r.get("compute_s") and r["round_s"]
    ]
    if computes:
        text += (
            "; torch work on the compute thread (cast, encode, decode, the node's finiteness and magnitude "
            f"checks, means) was {100 * statistics.median(computes):.0f}% of a matched round (median)"
        )
    matchmaking = [r["matchmaking_s"] for key, r in rounds.items() if key[3] == "allreduce"
                   and r.get("matchmaking_s") is not None]
    if matchmaking:
        text += (
            f". hivemind needed {min(matchmaking):.1f}-{max(matchmaking):.1f} s to form a group; it is kept "
            f"off the critical path here, a plain `step()` pays it every round"
        )
    return text + "."


def failure_paragraph(result: dict, rounds: dict[tuple, dict]) -> str:
    """The rounds where the node's pairing found no partner before its deadline."""
    failed = {key: r for key, r in rounds.items() if key[3] == "pair" and r["failed"]}
    if not failed:
        return ""
    twin_keys = [(*key[:3], "pair_matched", key[4]) for key in failed]
    twins = [rounds[key] for key in twin_keys if key in rounds]
    twin_failed, twin_total = sum(r["failed"] for r in twins), sum(r["failed"] + r["rounds"] for r in twins)
    cases = "; ".join(f"{_where(result, key[:3])}{' with stragglers' if key[4] else ''}: {r['failed']} of "
                      f"{r['failed'] + r['rounds']} rounds, {r['attempts']:.0f} proposals per peer"
                      for key, r in failed.items())
    return (
        f"**Where the node's pairing failed.** Some `pair` rounds ended without a partner (the local-only "
        f"step after the seek deadline: the node's round_timeout_s plus the time of one exchange): {cases}. "
        f"Matched pairs in the same configurations failed in {twin_failed} of {twin_total} rounds. The "
        f"errors the peers reported are in the caveats below."
    )


def straggler_paragraph(result: dict, rounds: dict[tuple, dict]) -> str:
    configs = [c for c in _configs(rounds) if all((*c, m, True) in rounds for m in METHODS)]
    if not configs:
        return ""
    s = result["summary"]
    examples = "; ".join(f"{_where(result, c)}: " + " / ".join(_num(rounds[(*c, m, True)]["mean_idle_s"])
                                                               for m in METHODS) + " s" for c in configs)
    return (
        f"**Stragglers** (the last quarter of the peers, at least one, {s['straggler_delay_s']:g} s late: an "
        f"inner phase of {s['inner_phase_s']:g} s at slow factor {s['slow_factor']:g}). Mean idle per peer, "
        f"pair / matched pair / all-reduce: {examples}. The all-reduce idles every punctual peer for the "
        f"whole delay; with matched pairs only a straggler's partner waits, and the node's pairing lets "
        f"punctual peers pair among themselves (only one left over waits). With N = 2 the only partner is "
        f"the straggler, so every method waits alike."
    )


def markdown(result: dict) -> str:
    rounds = _rounds(result)
    parts = [
        "## Sync cost: NoLoCo pair exchange vs hivemind all-reduce",
        f"The critical path of one outer round: each peer sends its phi and Delta (fp16) to one random peer "
        f"of its stage over one libp2p stream and gets the partner's back, with the node's own pairing, "
        f"transport and frame codec, against one `DecentralizedAverager` all-reduce over the same tensors "
        f"among all N peers of the stage ({result['summary'].get('compression', 'fp16').upper()} "
        f"compression). One process per peer, each with its own DHT and libp2p daemon; stage sizes are "
        f"tensors of that many fp32 parameters.",
        f"Command: `{rerun_command('sync_cost', result['mode'])}` ({result['mode']} mode; "
        "`--full` adds 50M parameters and 50 Mbit/s). "
        f"Measured in {result['wall_s']:.0f} s on {result['machine']['cpu_count']} CPUs.",
        "### One message (one payload over one stream, acknowledged)",
        message_table(result),
        "### One round, all peers ready at once (medians)",
        "`pair`: the node's pairing (a proposal to a random peer among those seeking, then the exchange); "
        "`matched pair`: "
        "the same exchange with partner and sender drawn ahead; `one exchange`: one request and its answer.",
        round_table(result),
        "### With stragglers: idle time per peer (ready until its round is done; `*` = straggler)",
        straggler_table(result),
        "![sync cost: round time and idle time against N](bench/results/sync_cost.png)",
        "### What it means",
        speed_paragraph(result, rounds),
        protocol_paragraph(result, rounds),
        failure_paragraph(result, rounds),
        straggler_paragraph(result, rounds),
        "Caveats:\n" + "\n".join(f"- {note}" for note in result["notes"]),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


# -- plot -----------------------------------------------------------------------------------
def plot(result: dict, path) -> None:
    """Round time (top) and mean idle with stragglers (bottom) against N, one column per
    setting and size, pair vs all-reduce."""
    rows = [r for r in result["rows"] if r["table"] == "round"]
    panels = list(dict.fromkeys((r["setting"], r["params"]) for r in rows))
    plt = pyplot()
    fig, axes = plt.subplots(2, len(panels), figsize=(3.4 * len(panels), 6.0), squeeze=False)
    for col, (setting, params) in enumerate(panels):
        for ax, slowed, key in ((axes[0][col], False, "round_s"), (axes[1][col], True, "mean_idle_s")):
            mine = [r for r in rows if (r["setting"], r["params"]) == (setting, params)
                    and (r["stragglers"] > 0) == slowed]
            for color, (method, style) in enumerate(zip(METHODS, ("o--", "o-", "s-"))):
                points = sorted((r["peers"],
                                 r[key]) for r in mine if r["method"] == method and r[key] is not None)
                if points:
                    ax.plot(*zip(*points), style, label=method, color=f"C{color}")
            failed = [f"{r['method']} failed at N = {r['peers']}" for r in mine if r[key] is None]
            if failed or not mine:
                ax.text(0.03, 0.97, "\n".join(failed) or "not measured at this size", transform=ax.transAxes,
                        va="top", fontsize=8, color="C3" if failed else "gray")
        axes[0][col].set_title(f"{_setting_label(result, setting)}, {_size(params)} params", fontsize=9)
        axes[1][col].set_xlabel("peers per stage (N)")
    peers = sorted({r["peers"] for r in rows})
    axes[0][0].set_ylabel("round critical path (s)")
    axes[1][0].set_ylabel("mean idle per peer, stragglers (s)")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(peers, [str(n) for n in peers])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

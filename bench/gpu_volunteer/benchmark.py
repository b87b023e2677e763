"""Benchmark: GPU volunteers on home links, each holding a pipeline stage, the card
EMULATED. ``small`` in 2 stages, 2 volunteers a stage, each a host of its own in the
multi-host test bed (tests/netbed: a network namespace, its uplink and downlink shaped
to 20 Mbit/s with ``tc tbf``, 30 ms of round trip between volunteers through the bed's
latency stage), each a real ``swarm-node join`` typed behind the emulated card's prefix
(bench/gpu_volunteer/card.py), activations and their gradients in each codec in turn,
in one sitting: fp16, int8 and the coded boundary bottleneck8 at 32x.

The card is EMULATED (bench/gpu_volunteer/emulation.py): a sixth of the H200's measured
eager rate per stage (bench/results/gpu_step.json; the last stage scaled to a 32k
vocabulary's head, bench/gpu_volunteer/plan.py), a stage's forward and backward a timed
wait of that length producing real tensors of the real shapes, which the node's own
data path encodes, sends, decodes and screens; weights and optimiser state dropped (a
stand-in of a few real parameters), the outer payload padded to the real stage's size in
the run's outer codec, a round every 60 s of inner steps on the same links.

Per codec, over a window of training after a warm-up, from the volunteers' own
/api/status counters: stage 0's tokens/s (both stage-0 volunteers), compute utilisation
(the emulated card's busy time over wall time, per volunteer and per stage), bytes a
token across the boundary as the nodes count them (forward request, gradient answer:
values, scales, headers, targets or token ids), the share of the time stage 0 waited on
its link with a full window, outer rounds with a partner, micro-batches lost; beside
them, what the links and the cards allow.

    .venv/bin/python -m bench.gpu_volunteer [--full]

Then the coded boundary once more on unshaped links (a shorter window, rounds not waited
for): what the emulation reaches on this machine, where the volunteers share 2 cores.

Quick: a window of 90 s a codec, then until every volunteer has closed an outer round, at
most 180 s; 60 s unshaped (about 12 minutes in all). Full: 600 s, then 5 rounds, at most
1200 s; 300 s unshaped.
``--work-dir DIR`` keeps every host's logs and files there."""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from bench.common.procs import unwind_on_sigterm
from bench.common.results import Result, grouped_bars, parse_mode, pyplot, rerun_command, save_plot
from bench.gpu_volunteer.plan import (
    BATCH,
    CODECS,
    FULL,
    QUICK,
    RATE_MBIT,
    ROUND_S,
    RTT_MS,
    SEQ,
    STAGES,
    VOLUNTEERS_PER_STAGE,
    CardTimes,
    boundary_bytes,
    card,
    card_times,
    card_tokens_per_s,
    codec_name,
    inner_steps,
    link_tokens_per_s,
    microbatch_s,
    outer_payload_bytes,
    run_spec,
)
from bench.gpu_volunteer.swarm import Ran, Sample, rounds_closed

NAME = "gpu_volunteer"
TARGET_UTILISATION = 0.8  # issue 55's acceptance for the coded boundary


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.split("\n\n")[0], argv, extra=lambda p: p.add_argument(
        "--work-dir", type=Path, default=None, help="keep the hosts' logs and files here (default: removed)"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from netbed import unavailable

    why = unavailable()
    if why:
        print(f"bench.{NAME}: {why}", file=sys.stderr)
        return 2
    from bench.gpu_volunteer import swarm

    unwind_on_sigterm()  # the test beds remove their hosts, and the nodes in them
    plan = FULL if args.full else QUICK
    times = card_times()
    result = Result(NAME, args.mode, args.out_dir)
    result.note(times.note())
    result.note("EMULATED: a stage's forward and backward are a timed wait of the card's time returning "
                "real tensors of the real shapes (drawn once from a seeded pool, not computed); weights and "
                "optimiser state are dropped (a stand-in of 16,384 real parameters, stepped on emulated "
                "gradients), each outer payload padded to the real stage's parameters in the run's outer "
                "codec; the model has a 32k vocabulary (the synthetic data's ids travel at its width); the "
                "loss is not a model's.")
    # and the coded boundary on unshaped links: what the emulation reaches on this machine
    runs = [(codec, ratio, RATE_MBIT) for codec, ratio in CODECS] + [(*CODECS[-1], None)]
    with tempfile.TemporaryDirectory(prefix="gpu-volunteer-") as tmp:
        root = args.work_dir or Path(tmp)
        for codec, ratio, rate_mbit in runs:
            h = inner_steps(codec, ratio, times)
            workdir = root / (codec if rate_mbit else f"{codec}-unshaped")
            workdir.mkdir(parents=True, exist_ok=True)
            links = f"{rate_mbit:g} Mbit/s links" if rate_mbit else "links unshaped"
            print(f"bench.{NAME}: {codec_name(codec, ratio)} activations, {links}, H = {h} (EMULATED card)",
                  file=sys.stderr, flush=True)
            ran = swarm.run(run_spec(codec, ratio, h), card(codec, ratio, times),
                            plan if rate_mbit else plan.reference(), workdir, rate_mbit=rate_mbit)
            row = result.add(**codec_row(codec, ratio, h, times, ran, rate_mbit))
            print(f"bench.{NAME}: {_brief(row)}", file=sys.stderr, flush=True)
    result.summary = summary(result.rows)
    result.note(f"Re-run: {rerun_command(NAME, args.mode)}")
    result.write()
    plot(result)
    return 0


# -- reading a run ------------------------------------------------------------------------
def _delta(first: Sample, last: Sample, i: int, key: str) -> float:
    return last.stats[i][key] - first.stats[i][key]


def _boundary_delta(first: Sample, last: Sample, indices: list[int], side: str) -> dict:
    """Bytes a token across the boundary in the window, pooled over ``indices``'s
    counters on ``side`` ("to_next": what stage 0 sent and got back; "from_previous":
    what stage 1 got and answered)."""
    sent = sum(last.stats[i][side]["sent"] - first.stats[i][side]["sent"] for i in indices)
    received = sum(last.stats[i][side]["received"] - first.stats[i][side]["received"] for i in indices)
    tokens = sum(last.stats[i][side]["tokens"] - first.stats[i][side]["tokens"] for i in indices)
    return {"sent": round(sent / max(1, tokens), 2), "received": round(received / max(1, tokens), 2),
            "tokens": tokens}


def codec_row(codec: str, ratio: float | None, h: int, times: CardTimes, ran: Ran,
              rate_mbit: float | None = RATE_MBIT) -> dict:
    """A run's row; ``rate_mbit`` None: the reference on unshaped links."""
    first, last = ran.samples[0], ran.samples[-1]
    window_s = last.t - first.t
    by_stage = {s: [i for i, st in enumerate(ran.stages) if st == s] for s in range(STAGES)}
    everyone = range(len(ran.stages))
    utilisation = [round(_delta(first, last, i, "training_s") / window_s, 3) for i in everyone]
    stage0 = by_stage[0]
    tokens = sum(_delta(first, last, i, "tokens") for i in stage0)
    request, answer = boundary_bytes(codec, ratio)
    return dict(
        activation_codec=codec, activation_ratio=ratio, emulated=True, rate_mbit=rate_mbit,
        name=codec_name(codec, ratio) + ("" if rate_mbit else ", links unshaped"),
        inner_steps=h, expected_microbatch_s=round(microbatch_s(codec, ratio, times), 4),
        window_s=round(window_s, 1), started_s=round(ran.started_s, 1),
        stage0_tokens_per_s=round(tokens / window_s, 1),
        link_allows_tokens_per_s=round(link_tokens_per_s(codec, ratio), 1) if rate_mbit else None,
        cards_allow_tokens_per_s=round(card_tokens_per_s(times), 1),
        compute_utilisation=utilisation,
        utilisation_by_stage={str(s): round(statistics.mean(utilisation[i] for i in idx), 3)
                              for s, idx in by_stage.items()},
        stages=ran.stages,
        # the nodes' counters (what /api/status shows as "boundaries"), over the window
        bytes_per_token_stage0={"0-1": _boundary_delta(first, last, stage0, "to_next")},
        bytes_per_token_stage1={"0-1": _boundary_delta(first, last, by_stage[1], "from_previous")},
        planned_bytes_per_token={"forward": round(request / (BATCH * SEQ), 2),
                                 "backward": round(answer / (BATCH * SEQ), 2)},
        # a wait is counted when it ends: one begun before the window can take it past 1
        link_wait_share=[round(min(1.0, _delta(first, last, i, "link_wait_s") / window_s), 3)
                         for i in stage0],
        link_wait_share_since_start=[last.stats[i]["link_wait_share"] for i in stage0],
        wire_bytes_per_token=round(sum(b - a for a, b in zip(first.tx_bytes, last.tx_bytes))
                                   / max(1, tokens), 1),
        rounds_with_partner=[int(_delta(first, last, i, "rounds_with_partner")) for i in everyone],
        local_only_rounds=[int(_delta(first, last, i, "local_only_rounds")) for i in everyone],
        rounds_closed=[rounds_closed(first, last, i) for i in everyone],
        rounds_with_partner_in_run=[s.get("rounds_with_partner", 0) for s in ran.summaries],
        microbatches_lost=int(sum(_delta(first, last, i, "microbatches_lost") for i in everyone)),
        microbatches_lost_in_run=sum(s.get("microbatches_lost", 0) for s in ran.summaries),
        outer_payload_mb=[round(b / 1e6, 1) for b in outer_payload_bytes(codec, ratio)],
        load_average=round(statistics.mean(sample.load for sample in ran.samples), 2),
        series=_series(ran, by_stage))


def _series(ran: Ran, by_stage: dict[int, list[int]]) -> list[list[float]]:
    """Per sampling interval: [seconds into the window, stage 0's and stage 1's mean
    utilisation, stage 0's tokens/s]."""
    out = []
    for a, b in zip(ran.samples, ran.samples[1:]):
        dt = b.t - a.t
        util = [statistics.mean(_delta(a, b, i, "training_s") / dt for i in idx) for idx in by_stage.values()]
        tokens = sum(_delta(a, b, i, "tokens") for i in by_stage[0]) / dt
        out.append([round(b.t - ran.samples[0].t, 1), *(round(u, 3) for u in util), round(tokens, 1)])
    return out


def summary(rows: list[dict]) -> dict:
    shaped = [r for r in rows if r["rate_mbit"] == RATE_MBIT]
    by = {r["activation_codec"]: r for r in shaped}
    coded = next((r for r in shaped if r["activation_ratio"] is not None), None)
    out = {"emulated": True, "rate_mbit": RATE_MBIT, "rtt_ms": RTT_MS, "round_s": ROUND_S,
           "volunteers_per_stage": VOLUNTEERS_PER_STAGE,
           "stage0_tokens_per_s": {r["name"]: r["stage0_tokens_per_s"] for r in rows},
           "lowest_stage_utilisation": {r["name"]: min(r["utilisation_by_stage"].values()) for r in rows},
           "unshaped_utilisation_by_stage": next(
               (r["utilisation_by_stage"] for r in rows if not r["rate_mbit"]), None)}
    if coded is not None and "fp16" in by:
        out["coded_tokens_per_s_vs_fp16"] = round(coded["stage0_tokens_per_s"]
                                                  / max(1e-9, by["fp16"]["stage0_tokens_per_s"]), 2)
        lowest = min(coded["utilisation_by_stage"].values())
        out["coded_meets_target_utilisation"] = lowest >= TARGET_UTILISATION
    return out


def _brief(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "series"}


# -- the report ---------------------------------------------------------------------------
def plot(result: Result) -> None:
    plt = pyplot()
    rows = result.rows
    fig, (bars, series) = plt.subplots(1, 2, figsize=(12, 4))
    grouped_bars(bars, rows, [f"stage {s}" for s in range(STAGES)],
                 lambda row, stage: row["utilisation_by_stage"][stage.split()[1]])
    bars.set_xticklabels([r["name"].replace(" at ", "\nat ").replace(", ", ",\n") for r in rows], fontsize=8)
    bars.axhline(TARGET_UTILISATION, color="grey", linestyle="--", linewidth=1)
    bars.set_ylim(0, 1)
    bars.set_ylabel("compute utilisation (EMULATED card)")
    bars.set_title(f"GPU volunteers, {RATE_MBIT:g} Mbit/s links, {RTT_MS:.0f} ms RTT")
    bars.legend(fontsize=8)
    for row in rows:
        t, u0, u1, _ = zip(*row["series"]) if row["series"] else ((), (), (), ())
        series.plot(t, [min(a, b) for a, b in zip(u0, u1)], marker=".", label=row["name"])
    series.set_ylim(0, 1.05)
    series.set_xlabel("seconds into the window")
    series.set_ylabel("lowest stage's utilisation, per interval")
    series.set_title(f"with the outer round every {ROUND_S:.0f} s of inner steps")
    series.legend(fontsize=8)
    save_plot(fig, result.out_dir, NAME)


def _allows(tokens_per_s: float | None) -> str:
    return "unshaped" if tokens_per_s is None else f"{tokens_per_s:,.0f}"


def markdown(result: dict) -> str:
    s, rows = result["summary"], result["rows"]
    lines = [
        "## gpu_volunteer: EMULATED GPU volunteers holding pipeline stages on home links",
        "",
        f"`{rerun_command(NAME, result['mode'])}` ({result['mode']} mode, {result['wall_s']:.0f} s)",
        "",
        f"`small` in {STAGES} stages, {VOLUNTEERS_PER_STAGE} volunteers a stage, each a host of its own in "
        f"the multi-host test bed (its uplink and downlink shaped to {s['rate_mbit']:g} Mbit/s with "
        "`tc tbf`, "
        f"{s['rtt_ms']:.0f} ms round trip between volunteers), each a real `swarm-node join` with its "
        f"stage; micro-batches of 8 x 1024 tokens; NoLoCo with the outer round every {s['round_s']:.0f} s "
        "of inner steps (H from the pace each codec's pipeline is expected to run at), phi and Delta in "
        "the run's outer codec on the same links. **The card is emulated** "
        "(bench/gpu_volunteer/emulation.py): a stage's forward and backward are a timed wait of a sixth "
        "of the H200's eager time (bench/results/gpu_step.json) returning real tensors of the real shapes, "
        "which the node's own data path encodes, sends, decodes and screens; the weights are dropped and "
        "each outer payload is padded to the real stage's size. Figures over the measured window, from "
        "the volunteers' own /api/status counters: compute utilisation is the emulated card's busy time "
        "over wall time; bytes a token are the boundary's frames as the nodes count them (values, "
        "scales, headers, targets or token ids), forward / back.",
        "",
        "| activations | H | stage-0 tokens/s | links allow | cards allow | compute utilisation, stage 0 / "
        "stage 1 | bytes a token across 0-1 | link wait (stage 0) | rounds closed: with a partner (local) | "
        "micro-batches lost |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["bytes_per_token_stage0"]["0-1"]
        util = " / ".join(f"{r['utilisation_by_stage'][str(st)]:.0%}" for st in range(STAGES))
        lines.append(
            f"| {r['name']} | {r['inner_steps']} | {r['stage0_tokens_per_s']:,.0f} | "
            f"{_allows(r['link_allows_tokens_per_s'])} | {r['cards_allow_tokens_per_s']:,.0f} | {util} | "
            f"{b['sent']:,.1f} / {b['received']:,.1f} | "
            f"{', '.join(f'{w:.0%}' for w in r['link_wait_share'])} | "
            f"{sum(r['rounds_with_partner'])} ({sum(r['local_only_rounds'])}) | {r['microbatches_lost']} |")
    lines += ["", f"![compute utilisation per stage and over time](bench/results/{NAME}.png)", ""]
    if "coded_tokens_per_s_vs_fp16" in s:
        coded = next(r for r in rows if r["activation_ratio"] is not None and r["rate_mbit"])
        verdict = "meets" if s["coded_meets_target_utilisation"] else "misses"
        lines += [f"{coded['name']} trains stage 0 at {s['coded_tokens_per_s_vs_fp16']:.1f}x fp16's tokens/s "
                  f"on the same links; its lowest stage's utilisation, "
                  f"{s['lowest_stage_utilisation'][coded['name']]:.0%}, {verdict} the "
                  f"{TARGET_UTILISATION:.0%} target. Outer payloads (each way, a round): "
                  + "; ".join(f"{r['name']} " + " / ".join(f"{mb:.0f} MB" for mb in r["outer_payload_mb"])
                              for r in rows if r["rate_mbit"]) + " (stage 0 / stage 1).", ""]
    reference = next((r for r in rows if not r["rate_mbit"]), None)
    if reference is not None:
        util = " / ".join(f"{u:.0%}" for u in reference["utilisation_by_stage"].values())
        lines += [f"On unshaped links (the same test bed, its 30 ms round trips, no rate limit) the same "
                  f"emulated pipeline reaches {util} (stage 0 / stage 1) and "
                  f"{reference['stage0_tokens_per_s']:,.0f} tokens/s: the ceiling of the emulation on this "
                  "machine, whose 2 cores all volunteers, the bootstrap and the bed's latency stage share "
                  "(each codec's encoding and decoding, the card's work on a GPU volunteer, is CPU work "
                  "here). Stage 0's ceiling is also its card's share of the slower stage 1's pace.", ""]
    if result["notes"]:
        lines += ["Notes:", "", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines) + "\n"

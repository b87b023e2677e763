"""The fast-link scenario of the swarm-efficiency benchmark (issue 34): a 2 x 2 swarm on
this machine's loopback (a link faster than any software on it) whose stages do the
least compute per byte they send that the model presets allow: the `debug` model (64
wide, one layer a stage) on 16 x 512-token micro-batches, about 1 MB of activations
forward and 1 MB of gradients back each. A CPU still computes a thousand times slower
than a GPU, so the bytes stay a few MB/s and transport a small share here; on a GPU the
same swarm is transport-bound. Run four times, the same way but for the path bulk bytes
take, in turns: libp2p streams through both p2pd daemons (``--no-lanes``, how every node
sent them before direct lanes) and direct lanes.

Transport's share of the machine: the CPU time of the p2pd daemons and of the nodes'
threads other than compute (event loops, lane threads, the wire thread that encodes and
decodes frames), over all the cores' time in the steady window. On this 2-core machine
every CPU-second moving bytes is one compute does not get, so the share is also what
the transport costs in wall time."""

from __future__ import annotations

from pathlib import Path

from bench.common.results import Result
from bench.swarm_efficiency.swarm import Plan, analyse_swarm, run_swarm

FAST_LINK_QUICK = Plan(model="debug", seq_len=512, batch_size=16, steps=66, inner_steps=20, window=(6, 60),
                       plain_warmup_steps=0, plain_steps=0, swarm_timeout_s=300, layouts=((2, 2),))
FAST_LINK_FULL = Plan(model="debug", seq_len=512, batch_size=16, steps=240, inner_steps=50, window=(15, 215),
                      plain_warmup_steps=0, plain_steps=0, swarm_timeout_s=900, layouts=((2, 2),))
PATHS = (("libp2p streams", False), ("direct lanes", True))
# The same swarm's tokens/s moved by a third between two sittings on these 2 cores
# (20,630 -> 28,324 over libp2p), far more than transport's whole share: so the two paths
# take turns, A B B A, and each row is the mean of its two.
TURNS = (0, 1, 1, 0)


def run_fast_link(plan: Plan, result: Result, work: Path) -> None:
    runs: dict[str, list[dict]] = {path: [] for path, _ in PATHS}
    for turn, index in enumerate(TURNS):
        path, lanes = PATHS[index]
        turn_dir = work / f"turn{turn}"
        turn_dir.mkdir()
        swarm = run_swarm(plan, 2, 2, turn_dir, lanes=lanes)
        analysis = analyse_swarm(swarm, plan)
        m, t = analysis.machine, analysis.throughput
        stage0 = next(row for row in analysis.stages if row["stage"] == 0)
        moved = sum(p["bytes_sent"] for p in swarm.summary["peers"])
        runs[path].append({"tokens_per_s": t["tokens_per_s"],
                           "transport_share": m["p2pd"] + m["event_loops"], "p2pd_share": m["p2pd"],
                           "node_io_share": m["event_loops"], "compute_share": sum(
                               m[c] for c in ("useful", "recompute", "serialisation", "outer", "other")),
                           "idle_share": m["idle"], "stage0_blocked": stage0["idle"],
                           "mb_per_s_whole_run": moved / 1e6 / swarm.summary["wall_s"],
                           "step_time_mean_s": t["step_time_mean_s"],
                           "microbatches_lost": t["microbatches_lost"],
                           "other_processes": m["other_processes"]})
    rows = {}
    for path, measured in runs.items():
        rows[path] = {"table": "fast_link", "path": path, "runs": len(measured),
                      **{key: sum(r[key] for r in measured) / len(measured) for key in measured[0]},
                      "microbatches_lost": sum(r["microbatches_lost"] for r in measured),
                      "tokens_per_s_each": [round(r["tokens_per_s"], 1) for r in measured]}
        result.add(**rows[path])
    before, after = rows["libp2p streams"], rows["direct lanes"]
    result.summary["fast_link"] = {
        "model": plan.model, "seq_len": plan.seq_len, "batch_size": plan.batch_size,
        "runs_each": len(TURNS) // 2,
        "tokens_per_s": {path: row["tokens_per_s"] for path, row in rows.items()},
        "transport_share": {path: row["transport_share"] for path, row in rows.items()},
        "speedup": after["tokens_per_s"] / before["tokens_per_s"]}

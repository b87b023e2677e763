"""Benchmark: hundreds of peers a stage, on the swarm-scale simulator (swarm_node/scale:
the node's own pairing, exchange, guard, chooser and membership code on a virtual
clock, no model compute).

    .venv/bin/python -m bench.scale [--full]

Every run: two stages, H = 50 inner steps of about a second (log-normal per peer, 5 %
stragglers 3x slower), links with round trips 10-200 ms and uplinks 5-500 Mbit/s
(log-uniform), 20 % of peers behind a NAT, 10 % of peers crashing per hour and as many
joining, the registry sharded at peers-per-stage / 4. For each N: NoLoCo as the node
runs it; beside it, at the sizes a 2-core machine can take, the registry in one key a
stage (as before sharding) and DiLoCo's all-stage round (the barrier baseline).
Figures are over the run after two rounds of warm-up. Quick: N = 16 and 64, 300
virtual seconds; full: N = 16 to 1024, 900 virtual seconds.

The real node processes beside the simulator at N = 16 (32 processes) are a run of
their own, bench/scale/processes.py; this benchmark's section shows its last result."""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from bench.common.results import Result, run_mode
from bench.scale.report import markdown, plot
from swarm_node.membership.registry import suggested_shards

__all__ = ["main", "markdown", "run"]

NAME = "scale"

@dataclass(frozen=True)
class Case:
    label: str  # noloco | one-key registry | diloco
    peers: int
    method: str = "noloco"
    shards: int | None = None  # None: peers / 4

@dataclass(frozen=True)
class Plan:
    duration_s: float
    cases: tuple[Case, ...]

def _cases(sizes: tuple[int, ...], one_key_up_to: int, diloco_up_to: int) -> tuple[Case, ...]:
    cases = [Case("noloco", n) for n in sizes]
    cases += [Case("one-key registry", n, shards=1) for n in sizes if n <= one_key_up_to]
    cases += [Case("diloco", n, method="diloco") for n in sizes if n <= diloco_up_to]
    return tuple(sorted(cases, key=lambda c: -c.peers))  # the longest first: two workers finish together

PLANS = {"quick": Plan(duration_s=300.0, cases=_cases((16, 64), one_key_up_to=64, diloco_up_to=16)),
         # one key a stage at 256 peers would take 40 minutes of 2 cores to show what 16 and 64 show
         "full": Plan(duration_s=900.0, cases=_cases((16, 64, 256, 1024), one_key_up_to=64,
                                                     diloco_up_to=256))}

SCENARIO = dict(stages=2, inner_steps=50, step_s=1.0, unreachable_share=0.2, crash_per_hour=0.1,
                rtt_ms=(10.0, 200.0), uplink_mbit_s=(5.0, 500.0))

shards_for = suggested_shards  # the rule `swarm-node local` and the example spec follow

def simulate(case: Case, duration_s: float, seed: int = 0) -> dict:
    """One run in this process (a worker of the pool): its figures and its cost."""
    import torch

    from swarm_node.scale.config import ScaleConfig
    from swarm_node.scale.vclock import run
    from swarm_node.scale.world import World

    torch.set_num_threads(1)
    config = ScaleConfig(peers_per_stage=case.peers, method=case.method, duration_s=duration_s, seed=seed,
                         registry_shards=shards_for(case.peers) if case.shards is None else case.shards,
                         **SCENARIO)
    started, cpu = time.perf_counter(), time.process_time()
    figures = run(World(config).run())
    return figures.as_dict() | {"label": case.label, "registry_shards": config.registry_shards,
                                "real_s": round(time.perf_counter() - started, 1),
                                "cpu_s": round(time.process_time() - cpu, 1)}

def run(mode: str, out_dir) -> Result:
    plan = PLANS[mode]
    result = Result(NAME, mode, out_dir)
    workers = max(1, min(2, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        futures = [(case, pool.submit(simulate, case, plan.duration_s)) for case in plan.cases]
        for case, future in futures:
            row = result.add(kind="run", **future.result())
            print(
                f"scale: {case.label} N = {case.peers}: partner share {row['partner_share']:.3f}, "
                f"{row['control_bytes_per_peer_min_median'] / 60e3:.1f} kB/s a peer ({row['real_s']:.0f} s)",
                flush=True,
            )
    result.summary = {"scenario": {k: list(v) if isinstance(v, tuple) else v for k, v in SCENARIO.items()},
                      "duration_s": plan.duration_s, "cases": len(plan.cases)}
    return result

def main(argv: list[str] | None = None) -> None:
    run_mode(__doc__.split("\n\n")[0], run, plot, argv)

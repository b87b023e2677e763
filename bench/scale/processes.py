"""Real node processes on this machine next to the swarm-scale simulator at the same size:
does the simulator pair, propose and read the registry as the real nodes do?

    .venv/bin/python -m bench.scale.processes [--stages 2] [--replicas 16] [--steps 300] [--inner-steps 10]

``swarm-node local`` starts a bootstrap DHT and stages x replicas node processes on
loopback (the debug model and one torch thread each: 32 processes of the real node,
each with its DHT child and p2pd). While they train, every process of the tree is
sampled for memory (PSS, so the pages a forked DHT child shares with its node count
once). Afterwards every node's summary gives its rounds, proposals, refusals and
registry operations, and its log the outcome of each round. Then the simulator runs
the same swarm: the same stages, peers, H, the inner-step time the real nodes measured,
loopback links, no churn, for as long as the real nodes trained.

The simulator measures after two rounds of warm-up; the real figures leave out rounds 0
and 1 the same way (from the nodes' logs)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import ROOT
from bench.common.results import RESULTS_DIR, Result
from swarm_node.membership.registry import suggested_shards

NAME = "scale_processes"
VENV_BIN = Path(sys.executable).parent
ROUND_LINE = re.compile(r"round (\d+): (averaged with|no partner found|no other peer)")
WARM_UP_ROUNDS = 2  # as the simulator's window (swarm_node/scale/world.py)
SAMPLE_EVERY_S = 5.0


@dataclass
class MemorySamples:
    """PSS in MB of each kind of process, every sample: node, DHT child, p2pd, reaper."""
    by_kind: dict[str, list[float]] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)  # kind -> most seen at once

    def add(self, kind: str, mb: float) -> None:
        self.by_kind.setdefault(kind, []).append(mb)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _pss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def classify(pid: int, parent_kind: str | None, parent_cmd: list[str]) -> str | None:
    """What a process of the local swarm's tree is: node, dht (a node's forked DHT child,
    the same command line as its parent), p2pd, reaper, or None (the local driver and
    its own bootstrap DHT)."""
    cmd = _cmdline(pid)
    if not cmd or not cmd[0]:
        return None
    if Path(cmd[0]).name == "p2pd":
        return "p2pd" if parent_kind in ("node", "dht") else None
    if "swarm_node.net.reaper" in cmd:
        return "reaper"
    if "join" in cmd and "swarm_node" in cmd:
        return "dht" if parent_kind == "node" and cmd == parent_cmd else "node"
    if parent_kind == "node" and cmd == parent_cmd:
        return "dht"
    return None


def sample_memory(root_pid: int, samples: MemorySamples) -> None:
    tree, counts = _children(), {}
    stack = [(child, None, []) for child in tree.get(root_pid, [])]
    while stack:
        pid, parent_kind, parent_cmd = stack.pop()
        kind = classify(pid, parent_kind, parent_cmd)
        cmd = _cmdline(pid)
        if kind is not None:
            mb = _pss_mb(pid)
            if mb is not None:
                samples.add(kind, mb)
                counts[kind] = counts.get(kind, 0) + 1
        stack.extend((child, kind, cmd) for child in tree.get(pid, []))
    for kind, n in counts.items():
        samples.processes[kind] = max(samples.processes.get(kind, 0), n)


def round_outcomes(log_text: str) -> list[tuple[int, bool]]:
    """(round, with a partner) for every round a node's log reports."""
    return [(int(m.group(1)), m.group(2) == "averaged with") for m in ROUND_LINE.finditer(log_text)]


def run_processes(args: argparse.Namespace, run_dir: Path) -> tuple[dict, MemorySamples]:
    cmd = [str(VENV_BIN / "swarm-node"), "local", "--stages", str(args.stages), "--replicas",
           str(args.replicas),
           "--model", "debug", "--data", "synthetic", "--steps", str(args.steps), "--inner-steps",
           str(args.inner_steps), "--threads-per-node", "1", "--eval-batches", "1", "--run-dir", str(run_dir),
           "--json-out", str(run_dir / "local-summary.json"), "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    samples = MemorySamples()
    with open(run_dir / "local.log", "wb") as out:
        local = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        stop = threading.Event()

        def sampler() -> None:
            while not stop.wait(SAMPLE_EVERY_S):
                sample_memory(local.pid, samples)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        try:
            returncode = local.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            local.terminate()
            local.wait(timeout=60)
            log_file = run_dir / "local.log"
            raise RuntimeError(f"the local swarm ran past {args.timeout_s} s; see {log_file}") from None
        finally:
            stop.set()
            thread.join()
    if returncode != 0:
        raise RuntimeError(f"swarm-node local failed ({returncode}); see {run_dir / 'local.log'}")
    (run_dir / "memory.json").write_text(json.dumps({"by_kind": samples.by_kind,
                                                     "processes": samples.processes}))
    return json.loads((run_dir / "local-summary.json").read_text()), samples


def read_run(run_dir: Path) -> tuple[dict, MemorySamples]:
    """A finished run's summary and memory samples, to figure it again."""
    memory = json.loads((run_dir / "memory.json").read_text())
    return (json.loads((run_dir / "local-summary.json").read_text()),
            MemorySamples(by_kind=memory["by_kind"], processes=memory["processes"]))


def real_figures(run_dir: Path, summary: dict) -> dict:
    nodes = [json.loads(p.read_text()) for p in sorted(run_dir.glob("summary-stage*.json"))]
    outcomes = [
        o
        for log in sorted(run_dir.glob("node-s*.log"))
        for o in round_outcomes(log.read_text(errors="replace"))
    ]
    window = [with_partner for round_no, with_partner in outcomes if round_no >= WARM_UP_ROUNDS]
    rounds = sum(n["rounds_with_partner"] + n["local_only_rounds"] for n in nodes)
    minutes = [n["training_wall_s"] / 60 for n in nodes if n["training_wall_s"] > 0]
    step_s = [n["training_wall_s"] / n["inner_steps"] for n in nodes if n["inner_steps"] > 0]
    per_min = {k: statistics.mean(n[f"dht_{k}"] / m for n, m in zip(nodes, minutes))
               for k in ("gets", "entries_read", "stores")}
    proposals = sum(n["proposals_sent"] for n in nodes)
    return {
        "nodes": len(nodes),
        "rounds": rounds,
        "rounds_in_window": len(window),
        "partner_share": sum(window) / max(1, len(window)),
        "partner_share_all_rounds": sum(n["rounds_with_partner"] for n in nodes) / max(1, rounds),
        "proposals_per_round": proposals / max(1, rounds),
        # what control messages and the DHT took here (2 cores for every process): the simulator's links
        "proposal_s_mean": sum(n["proposal_s"] for n in nodes) / max(1, proposals),
        "dht_get_s_mean": sum(n["dht_get_s"] for n in nodes) / max(1, sum(n["dht_gets"] for n in nodes)),
        "dht_store_s_mean": sum(n["dht_store_s"] for n in nodes)
        / max(1, sum(n["dht_stores"] for n in nodes)),
        "refusals_per_round": sum(n["proposals_refused"] for n in nodes) / max(1, rounds),
        "step_s_median": statistics.median(step_s),
        "training_s_median": 60 * statistics.median(minutes),
        # how far apart the nodes' speeds were: how many reach a round's end at once
        "step_s_log_sigma": statistics.pstdev(math.log(s) for s in step_s),
        # the outer round's parts on the compute thread (queueing behind inner steps
        # included), which the model-free stage does in no time: a node busy with a
        # round refuses proposals ("busy"), 4 in 10 of the real refusals
        "round_prepare_s_mean": sum(n["round_prepare_s"] for n in nodes) / max(1, rounds),
        "round_close_s_mean": sum(n["round_close_s"] for n in nodes) / max(1, rounds),
        "round_exchange_s_mean": sum(n["round_exchange_s"] for n in nodes)
        / max(1, sum(n["round_exchanges"] for n in nodes)),
        "refused_busy_share": sum(n.get("proposals_refused_busy", 0) for n in nodes)
        / max(1, sum(n["proposals_refused"] for n in nodes)),
        "registry_ops_per_peer_min": per_min,
        "microbatches_lost": sum(n["microbatches_lost"] for n in nodes),
        "bytes_sent_per_peer_min": statistics.mean(n["bytes_sent"] / m for n, m in zip(nodes, minutes)),
        "final_val_loss": summary.get("final_val_loss"),
    }


# The debug model's outer payload in near4-3 and one micro-batch's activations in fp16
# (8 x 64 tokens of hidden size 64): what an exchange and a forward carry here.
PAYLOAD_BYTES, ACTIVATION_BYTES = 50_000, 65_536


def simulated_figures(args: argparse.Namespace, real: dict, seeds: int, calibrated: bool) -> list[dict]:
    """The simulator with the real run's shape: its stages, peers, H, the inner-step time
    the nodes measured, the debug model's payloads, no churn. Links: loopback (0.1-1 ms
    round trips), or, ``calibrated``, what a control message took in the real run (the
    mean proposal's answer: every process of the swarm shares 2 cores, so loopback
    answers in hundreds of milliseconds), and DHT gets and stores that take as long as
    the real ones did (seconds: each is several RPCs through the DHT processes and p2pd
    daemons of nodes that are all busy)."""
    from swarm_node.local.swarm import LocalConfig
    from swarm_node.node_config import NodeConfig
    from swarm_node.scale.config import ScaleConfig
    from swarm_node.scale.vclock import run
    from swarm_node.scale.world import World

    rtt_ms = (1000 * real["proposal_s_mean"],) * 2 if calibrated else (0.1, 1.0)
    delay_s = (0.05, 0.5)
    dht = {"dht_get_s": real["dht_get_s_mean"], "dht_store_s": real["dht_store_s_mean"]} if calibrated else {}
    out = []
    for seed in range(seeds):
        config = ScaleConfig(peers_per_stage=args.replicas, stages=args.stages, inner_steps=args.inner_steps,
                             duration_s=real["training_s_median"], step_s=real["step_s_median"],
                             speed_sigma=real["step_s_log_sigma"], rtt_ms=rtt_ms,
                             round_prepare_s=real["round_prepare_s_mean"],
                             round_close_s=real["round_close_s_mean"],
                             # the exchange beyond its messages' round trip: decoding and checking
                             round_check_s=max(0.0, real["round_exchange_s_mean"] - real["proposal_s_mean"]),
                             uplink_mbit_s=(2000.0, 2000.0), straggler_share=0.0, record_delay_s=delay_s,
                             payload_bytes=PAYLOAD_BYTES, activation_bytes=ACTIVATION_BYTES, seed=seed,
                             registry_shards=suggested_shards(args.replicas), **dht)
        nodes = NodeConfig(round_timeout_s=LocalConfig.round_timeout_s)  # as swarm-node local runs them
        figures = run(World(config, node_config=nodes).run()).as_dict()
        out.append(figures | {"links": "calibrated" if calibrated else "loopback", "rtt_ms": rtt_ms[0],
                              "record_delay_s": list(delay_s), "dht_get_s": config.dht_get_s,
                              "dht_store_s": config.dht_store_s})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.processes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=16, help="node processes a stage")
    parser.add_argument("--steps", type=int, default=300, help="inner steps of each stage-0 node")
    parser.add_argument("--inner-steps", type=int, default=10, help="H")
    parser.add_argument("--seeds", type=int, default=3, help="simulator runs (seeds) beside the real one")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the nodes' logs and summaries here")
    parser.add_argument(
        "--from-run-dir",
        action="store_true",
        help="start nothing: figure the finished run in --run-dir again (and run the simulator)",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = Result(NAME, "quick", args.out_dir)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="swarm-scale-processes-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    summary, samples = read_run(run_dir) if args.from_run_dir else run_processes(args, run_dir)
    real = real_figures(run_dir, summary)
    result.note(
        f"swarm-node local ran {summary['wall_s']:.0f} s (start-up, training, evaluation)"
        + (
            "; these figures were computed again from its files (--from-run-dir) with the simulator as it is "
            "now"
            if args.from_run_dir
            else ""
        )
        + "."
    )
    result.add(kind="real", stages=args.stages, peers_per_stage=args.replicas, inner_steps=args.inner_steps,
               registry_shards=suggested_shards(args.replicas), **real)
    for kind, values in sorted(samples.by_kind.items()):
        result.add(kind="memory", process=kind, count=samples.processes.get(kind, 0),
                   pss_mb_median=round(statistics.median(values), 1), pss_mb_max=round(max(values), 1))
    result.summary = {"run_dir": str(run_dir)}
    for calibrated in (False, True):
        sims = simulated_figures(args, real, args.seeds, calibrated)
        for seed, sim in enumerate(sims):
            result.add(kind="simulated", seed=seed,
                       **{k: v for k, v in sim.items() if not isinstance(v, dict)},
                       registry_ops_per_peer_min=sim["registry_ops_per_peer_min"])
        share = statistics.mean(s["partner_share"] for s in sims)
        proposals = statistics.mean(s["proposals_per_round"] for s in sims)
        result.summary[sims[0]["links"]] = {
            "partner_share": {"real": round(real["partner_share"], 3), "simulated": round(share, 3),
                              "points_apart": round(100 * abs(real["partner_share"] - share), 1)},
            "proposals_per_round": {"real": round(real["proposals_per_round"], 2),
                                    "simulated": round(proposals, 2),
                                    "ratio": round(proposals / real["proposals_per_round"], 2)
                                    if real["proposals_per_round"] else None}}
    path = result.write()
    print(json.dumps(result.summary, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

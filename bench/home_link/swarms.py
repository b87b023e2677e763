"""The swarms of bench.home_link, each on a test bed of its own (tests/netbed): a
bootstrap host, and one host per volunteer whose access link has the scenario's rate
each way and RTT_MS / 2 of latency (so RTT_MS between two volunteers).

- ``run_one_stage``: volunteers of swarm-node holding the whole model, each typing the
  bootstrap's join line; their checkpoints (one a round) are copied as snapshots for
  the loss-against-time curve.
- ``run_two_stages``: 2 stages x 2 volunteers; stage 0 stops at a given step.
- ``run_hivemind``: hivemind.Optimizer peers (bench/vs_hivemind/peer.py, local updates)
  training the same model on the same data, on the same links, snapshotting every H steps.

Every run returns what its volunteers wrote and the bytes each host sent into its link."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import ROOT
from bench.common.snapshots import CheckpointCopier

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "multihost")]  # the test bed and its swarm helpers
from netbed import Host, TestBed, host_env  # noqa: E402 (found through the sys.path line above)
from swarm_hosts import VENV_BIN, BootstrapOnHost, Volunteer, wait_for  # noqa: E402 (found through the sys.path line above)

from swarm_node.spec import RunSpec  # noqa: E402
from swarm_node.wire.outer_codec import outer_codec  # noqa: E402

RTT_MS = 50.0  # between two volunteers: 25 ms on each one's access link
TIME_LIMIT_S = 1800


@dataclass
class Ran:
    spec: RunSpec
    launched: float  # time.time() when the volunteers were started
    nodes: list[dict] = field(default_factory=list)  # swarm-node: each volunteer's summary
    weights: list[Path] = field(default_factory=list)  # swarm-node: each volunteer's final weights
    tx_bytes: list[int] = field(default_factory=list)  # what each volunteer's host sent into its link
    snapshot_dir: Path | None = None
    training_started_s: float | None = None  # since launch: when the last volunteer began to train
    stopped_at_limit: bool = False  # hivemind: its peers ran past the time limit and were stopped


@contextmanager
def _bed(label: str, spec: RunSpec, workdir: Path) -> Iterator[tuple[TestBed, BootstrapOnHost]]:
    spec_path = workdir / "spec.json"
    spec.write_json(spec_path)
    with TestBed(label) as bed:
        yield bed, BootstrapOnHost(bed, bed.add_host("boot"), workdir, "--run-spec", str(spec_path))


def _host(bed: TestBed, i: int, rate_mbit: float) -> Host:
    return bed.add_host(f"v{i}", rate_mbit=rate_mbit, rtt_ms=RTT_MS / 2)


def _sent(bed: TestBed, hosts: list[Host], before: list[int]) -> list[int]:
    return [bed.tx_bytes(h) - b for h, b in zip(hosts, before)]


def _node_outputs(volunteer: Volunteer) -> tuple[dict, Path]:
    run = volunteer.workdir / "run"
    return json.loads(next(run.glob("summary-*.json")).read_text()), next(run.glob("weights-*.pt"))


def blocking_seek_s(params: int, rate_mbit: float) -> float:
    """How long a blocking round seeks its partner. One payload at a time, the side that
    asked gets its answer one payload's time after the other side is done, and starts
    its next inner steps that much later: a partner seeking for less (the default 20 s;
    31 s of payload at 3.5 Mbit/s) gives up before the other arrives, and half the
    rounds went local-only, skipping the very wait this scenario measures."""
    payload_s = params * outer_codec("fp16").bytes_per_parameter() * 8 / (rate_mbit * 1e6)
    return max(20.0, 1.5 * payload_s)


def run_one_stage(spec: RunSpec, volunteers: int, rate_mbit: float, workdir: Path, *, blocking: bool,
                  param_names: list[str], params: int) -> Ran:
    steps = spec.total_steps
    snapshots = workdir / "snapshots"
    snapshots.mkdir(parents=True, exist_ok=True)
    with _bed("hl", spec, workdir) as (bed, boot):
        line = boot.join_line()
        hosts = [_host(bed, i, rate_mbit) for i in range(volunteers)]
        before = [bed.tx_bytes(h) for h in hosts]
        ran = Ran(spec, time.time(), snapshot_dir=snapshots)
        extra = ["--max-steps", str(steps), "--threads", "1", "--run-dir", "run", "--no-progress",
                 "--no-state-download", "--slowest-link-mbit", str(rate_mbit), "--checkpoint-dir", "ckpt",
                 *(["--blocking-rounds", "--one-payload-at-a-time", "--round-timeout",
                    f"{blocking_seek_s(params, rate_mbit):.0f}"] if blocking else [])]
        nodes = [Volunteer(bed, h, workdir, line, *extra, "--data-shard", f"{i}/{volunteers}",
                           full_speed=True)
                 for i, h in enumerate(hosts)]
        copier = CheckpointCopier({i: v.workdir / "ckpt" for i, v in enumerate(nodes)}, snapshots,
                                  param_names)
        _wait_ticking(lambda: all(v.process.poll() is not None for v in nodes), copier.tick,
                      f"the volunteers to finish {steps} steps", workdir)
        _raise_for_failures(nodes)
        ran.tx_bytes = _sent(bed, hosts, before)
    for summary, weights in map(_node_outputs, nodes):
        ran.nodes.append(summary)
        ran.weights.append(weights)
    ran.training_started_s = max(n["training_started_unix"] for n in ran.nodes) - ran.launched
    return ran


def run_two_stages(spec: RunSpec, rate_mbit: float, workdir: Path, steps: int) -> Ran:
    """2 stages x 2 volunteers; stage 0 stops at ``steps``, then stage 1 is stopped."""
    with _bed("hs", spec, workdir) as (bed, boot):
        line = boot.join_line()
        hosts = [_host(bed, i, rate_mbit) for i in range(4)]
        before = [bed.tx_bytes(h) for h in hosts]
        ran = Ran(spec, time.time())
        nodes = []
        for i, host in enumerate(hosts):
            stage = i % 2
            extra = ["--stage", str(stage), "--threads", "1", "--run-dir", "run", "--no-progress",
                     "--no-state-download", "--slowest-link-mbit", str(rate_mbit)]
            if stage == 0:
                extra += ["--max-steps", str(steps), "--data-shard", f"{i // 2}/2"]
            nodes.append(Volunteer(bed, host, workdir, line, *extra, full_speed=True))
        firsts = nodes[0::2]
        wait_for(lambda: all(v.process.poll() is not None for v in firsts), TIME_LIMIT_S,
                 f"stage 0 to finish {steps} steps", workdir)
        _raise_for_failures(firsts)
        bed.stop_processes(*hosts[1::2])
        ran.tx_bytes = _sent(bed, hosts, before)
    ran.nodes = [_node_outputs(v)[0] for v in nodes]
    return ran


def run_hivemind(spec: RunSpec, volunteers: int, rate_mbit: float, workdir: Path, data: str,
                 time_limit_s: float) -> Ran:
    """hivemind.Optimizer with local updates, averaging parameters every H local steps
    per peer (an epoch), as its docs set it up; the run spec's model, data, inner
    optimizer and schedule. Peers still training after ``time_limit_s`` are stopped:
    the run is what they trained by then."""
    snapshots = workdir / "snapshots"
    snapshots.mkdir(parents=True, exist_ok=True)
    maddr_file = workdir / "bootstrap.maddrs"
    peer = [str(VENV_BIN / "python"), "-m", "bench.vs_hivemind.peer"]
    listen = ["--host-maddrs", "/ip4/0.0.0.0/tcp/0"]
    with TestBed("hm") as bed:
        boot_host = bed.add_host("boot")
        bed.popen(boot_host, [*peer, "bootstrap", "--maddr-file", str(maddr_file), *listen], cwd=ROOT,
                  env=host_env(), log=workdir / "bootstrap.log")
        wait_for(maddr_file.exists, 60, "the hivemind bootstrap to write its address", workdir)
        hosts = [_host(bed, i, rate_mbit) for i in range(volunteers)]
        before = [bed.tx_bytes(h) for h in hosts]
        ran = Ran(spec, time.time(), snapshot_dir=snapshots)
        logs = [workdir / f"peer-{i}.log" for i in range(volunteers)]
        peers = [bed.popen(h, [*peer, "train", "--maddr-file", str(maddr_file), "--out-dir", str(snapshots),
                               "--rank", str(i), "--peers", str(volunteers), "--model", spec.model_size,
                               "--data",
                               data, "--seq-len", str(spec.seq_len), "--batch-size", str(spec.batch_size),
                               "--steps", str(spec.total_steps), "--inner-steps",
                               str(spec.method.inner_steps),
                               "--lr", str(spec.inner.lr), "--warmup-steps", str(spec.inner.warmup_steps),
                               "--seed", str(spec.seed), "--averaging-timeout-s", "60", *listen],
                           cwd=ROOT, env=host_env(), log=log)
                 for i, (h, log) in enumerate(zip(hosts, logs))]
        deadline = time.monotonic() + time_limit_s
        while time.monotonic() < deadline and any(p.poll() is None for p in peers):
            time.sleep(0.5)  # polling the peers' exit, not synchronisation
        ran.stopped_at_limit = any(p.poll() is None for p in peers)
        bed.stop_processes(*hosts)
        failed = [
            str(log)
            for p, log in zip(peers, logs)
            if p.returncode not in (0, -15) and not ran.stopped_at_limit
        ]
        if failed:
            raise RuntimeError(f"hivemind peers failed: {', '.join(failed)}")
        ran.tx_bytes = _sent(bed, hosts, before)
    starts = [torch.load(p)["time"] for p in snapshots.glob("snap-r*-0000000.pt")]  # step 0: training begins
    ran.training_started_s = max(starts) - ran.launched if len(starts) == volunteers else None
    ran.nodes = [{"log": log.read_text(errors="replace")} for log in logs]
    return ran


def _wait_ticking(done: Callable[[], bool], tick: Callable[[], None], what: str, workdir: Path) -> None:
    def check() -> bool:
        tick()
        return done()

    wait_for(check, TIME_LIMIT_S, what, workdir)
    tick()


def _raise_for_failures(volunteers: list[Volunteer]) -> None:
    failed = [str(v.log) for v in volunteers if v.process.returncode != 0]
    if failed:
        raise RuntimeError(f"volunteers failed: {', '.join(failed)}")

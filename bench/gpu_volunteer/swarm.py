"""One run of bench.gpu_volunteer, on a test bed of its own (tests/netbed): a bootstrap
host with the run's spec, and one host per volunteer whose access link has RATE_MBIT each
way and RTT_MS / 2 of latency (so RTT_MS between two volunteers). Each volunteer types the
bootstrap's join line behind the EMULATED card's prefix (bench/gpu_volunteer/card.py),
with its stage, and serves /api/status inside its host; the run is read there, every
few seconds of the measured window, with the bytes each host sent into its link."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import ROOT
from bench.gpu_volunteer.emulation import EmulatedCard
from bench.gpu_volunteer.plan import RATE_MBIT, RTT_MS, STAGES, VOLUNTEERS_PER_STAGE, Plan

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "multihost")]  # the test bed and its swarm helpers
from netbed import Host, TestBed  # noqa: E402 (found through the sys.path line above)
from swarm_hosts import VENV_BIN, BootstrapOnHost, Volunteer, wait_for  # noqa: E402 (as above)

from swarm_node.spec import RunSpec  # noqa: E402

STATUS_PORT = 8080  # every volunteer's, inside its own host
STARTUP_LIMIT_S = 600  # from the first volunteer's start to every stage-0 volunteer's warm-up


@dataclass
class Sample:
    t: float  # time.monotonic() as the volunteers were read
    stats: list[dict]  # each volunteer's /api/status "stats" (its counters)
    tx_bytes: list[int]  # what each volunteer's host had sent into its link
    load: float = 0.0  # this machine's 1-minute load average (the volunteers share its cores)


@dataclass
class Ran:
    stages: list[int]  # each volunteer's
    samples: list[Sample] = field(default_factory=list)
    summaries: list[dict] = field(default_factory=list)  # what each wrote at exit
    started_s: float = 0.0  # from the volunteers' start to the window's


def card_line(join_line: str, card_path: Path) -> str:
    """The bootstrap's ``swarm-node join ...`` line, run with the emulated card."""
    command, rest = join_line.split(" ", 1)
    if command != "swarm-node":
        raise ValueError(f"not a join line: {join_line!r}")
    python = shlex.quote(str(VENV_BIN / "python"))
    return (f"env PYTHONPATH={shlex.quote(str(ROOT))} {python} -m bench.gpu_volunteer.card "
            f"--card {shlex.quote(str(card_path))} {rest}")


def volunteer_flags(index: int) -> list[str]:
    stage = index % STAGES
    flags = ["--stage", str(stage), "--threads", "1", "--run-dir", "run", "--no-progress",
             "--no-state-download", "--slowest-link-mbit", f"{RATE_MBIT:g}", "--http-port", str(STATUS_PORT),
             "--wait-for-peers", str(VOLUNTEERS_PER_STAGE)]
    if stage == 0:
        flags += ["--data-shard", f"{index // STAGES}/{VOLUNTEERS_PER_STAGE}"]
    return flags


def run(spec: RunSpec, card: EmulatedCard, plan: Plan, workdir: Path,
        rate_mbit: float | None = RATE_MBIT) -> Ran:
    """The run on links of ``rate_mbit`` each way (None: unshaped, the bed's ceiling)."""
    spec_path = workdir / "spec.json"
    spec.write_json(spec_path)
    card_path = card.write(workdir / "card.json")
    with TestBed("gv") as bed:
        boot = BootstrapOnHost(bed, bed.add_host("boot"), workdir, "--run-spec", str(spec_path))
        line = card_line(boot.join_line(), card_path)
        count = STAGES * VOLUNTEERS_PER_STAGE
        hosts = [bed.add_host(f"v{i}", rate_mbit=rate_mbit, rtt_ms=RTT_MS / 2) for i in range(count)]
        launched = time.monotonic()
        volunteers = [Volunteer(bed, h, workdir, line, *volunteer_flags(i), full_speed=True)
                      for i, h in enumerate(hosts)]
        ran = Ran(stages=[i % STAGES for i in range(count)])

        def warm() -> bool:
            _raise_for_exits(volunteers)
            stats = [_status(bed, h) for h in hosts]
            return all(s is not None and s.get("state") == "training" for s in stats) and all(
                s["stats"]["microbatches_done"] >= plan.warmup_microbatches
                for s, stage in zip(stats, ran.stages) if stage == 0)

        wait_for(warm, STARTUP_LIMIT_S, "every volunteer to train and stage 0 to warm up", workdir)
        ran.started_s = time.monotonic() - launched
        ran.samples.append(_sample(bed, hosts))
        while not window_closed(plan, ran.samples):
            time.sleep(plan.sample_s)  # the sampling period, not synchronisation
            _raise_for_exits(volunteers)
            ran.samples.append(_sample(bed, hosts))
        bed.stop_processes(*hosts)
    ran.summaries = [_summary(v) for v in volunteers]
    return ran


def rounds_closed(first: Sample, last: Sample, i: int) -> int:
    """Outer rounds volunteer ``i`` closed between two samples, with a partner or local-only."""
    kinds = ("rounds_with_partner", "local_only_rounds")
    return sum(int(last.stats[i][k] - first.stats[i][k]) for k in kinds)


def window_closed(plan: Plan, samples: list[Sample]) -> bool:
    """Whether the measured window is over (Plan says when)."""
    first, last = samples[0], samples[-1]
    elapsed = last.t - first.t
    if elapsed >= plan.max_window_s:
        return True
    return elapsed >= plan.window_s and all(rounds_closed(first, last, i) >= plan.rounds
                                            for i in range(len(last.stats)))


def _status(bed: TestBed, host: Host) -> dict | None:
    def fetch() -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{STATUS_PORT}/api/status", timeout=10) as reply:
                return json.loads(reply.read())
        except (urllib.error.URLError, OSError, ValueError):  # not serving (yet)
            return None

    return bed.call(host, fetch, timeout_s=30)


def _sample(bed: TestBed, hosts: list[Host]) -> Sample:
    now = time.monotonic()
    statuses = [_status(bed, h) for h in hosts]
    missing = [h.name for h, s in zip(hosts, statuses) if s is None]
    if missing:
        raise RuntimeError(f"volunteers {', '.join(missing)} stopped answering /api/status")
    return Sample(now, [s["stats"] for s in statuses], [bed.tx_bytes(h) for h in hosts], os.getloadavg()[0])


def _raise_for_exits(volunteers: list[Volunteer]) -> None:
    gone = [f"{v.log} (exit {v.process.returncode})" for v in volunteers if v.process.poll() is not None]
    if gone:
        raise RuntimeError(f"volunteers exited during the run: {', '.join(gone)}")


def _summary(volunteer: Volunteer) -> dict:
    found = sorted((volunteer.workdir / "run").glob("summary-*.json"))
    return json.loads(found[0].read_text()) if found else {}

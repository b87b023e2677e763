"""Two `swarm-node join` typed by one script on one host, in the same second, without
--port (a machine with two GPUs, one node per card). Before the port claim (net/ports.py)
both daemons bound 31338 with SO_REUSEPORT, the kernel dealt the bootstrap's dial-back to
either process, one node took itself to be behind a NAT and neither trained. Now, ten
tries out of ten, one stops at once with the README's one-line error (exit status 2) and
the other trains, reachable; with --port 0 both train and average with each other.

The run has one stage, so a lone node trains and two of them pair. Slow tier: each try
starts two real nodes on a loaded 2-core machine (about 30 s a try)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from netbed import stop
from swarm_hosts import BootstrapOnHost, run_spec_file, volunteer_env, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TRIES = 10
PORT_LINE = re.compile(r"^swarm-node join: error: TCP port 31338 is in use \(.*\)$", re.MULTILINE)


def one_stage_spec(workdir):
    path = run_spec_file(workdir, inner_steps=5, run_id="two-on-one-host")
    path.write_text(re.sub(r"(?m)^num_stages = \d+", "num_stages = 1", path.read_text()))
    return path


def start_pair(bed, host, workdir, line: str, *extra: str, tag: str) -> tuple[subprocess.Popen, list[Path]]:
    """Both nodes from one shell line, `&` between them, as a start-up script would."""
    logs = [workdir / f"{tag}-{card}.log" for card in (0, 1)]
    for log in logs:
        log.write_text("")
    command = " & ".join(f"({line} --device cpu --threads 1 --no-progress {' '.join(extra)} > {log} 2>&1; "
                         f"echo exit status $? >> {log})" for log in logs) + " & wait"
    shell = bed.popen(host, ["bash", "-c", command], cwd=workdir, env=volunteer_env())
    return shell, logs


def node_id(log) -> str | None:
    found = re.search(r"node (\w+): stage \d+ of", log.read_text(errors="replace"))
    return found.group(1) if found else None


def peer(boot, tail: str) -> dict | None:
    """The bootstrap's row for the node whose logs show ``tail`` (short ids are tails)."""
    return next((p for p in boot.peers() if p["peer_id"].endswith(tail)), None)


def trains(row: dict | None, steps: int = 3) -> bool:
    return bool(row and row["state"] == "training" and row["verified"] and row["reachable"]
                and row["inner_step"] >= steps)


def started_ids(logs: list[Path]) -> list[str] | None:
    found = [node_id(log) for log in logs]
    return found if all(found) else None


def one_try(bed, boot, host, workdir: Path, line: str, attempt: int) -> tuple[int, str]:
    """Both nodes started at once; returns which one stopped, and its last line."""
    shell, logs = start_pair(bed, host, workdir, line, tag=f"try{attempt}")

    def one_stopped_on_the_port():
        texts = [log.read_text(errors="replace") for log in logs]
        stopped = [i for i, text in enumerate(texts) if "exit status" in text]
        return texts if len(stopped) == 1 and PORT_LINE.search(texts[stopped[0]]) else None

    texts = wait_for(one_stopped_on_the_port, 120, f"try {attempt}: one node to stop on the port", workdir)
    loser = next(i for i, text in enumerate(texts) if "exit status" in text)
    *_, last_line, status = texts[loser].strip().splitlines()
    assert PORT_LINE.fullmatch(last_line) and status == "exit status 2", texts[loser][-2000:]
    winner_log = logs[1 - loser]
    winner = wait_for(lambda: node_id(winner_log), 120, f"try {attempt}: the other node to start", workdir)
    wait_for(lambda: trains(peer(boot, winner)), 180, f"try {attempt}: the other node to train, reachable",
             workdir)
    winner_text = winner_log.read_text(errors="replace")
    assert "NAT" not in winner_text and "exit status" not in winner_text
    stop(shell, 30.0)  # SIGTERM to the script's process group: the winner too
    return loser, last_line


def test_two_joins_in_the_same_second_one_stops_with_the_port_line_the_other_trains(bed, tmp_path):
    boot = BootstrapOnHost(bed, bed.add_host("boot"), tmp_path, "--run-spec", str(one_stage_spec(tmp_path)))
    line = boot.join_line()
    host = bed.add_host("gpus2")
    outcomes = [one_try(bed, boot, host, tmp_path, line, attempt) for attempt in range(TRIES)]
    print("\n".join(f"try {i}: node {loser} stopped with: {text}" for i, (loser,
                                                                          text) in enumerate(outcomes)))

    shell, logs = start_pair(bed, host, tmp_path, line, "--port", "0", tag="port0")
    ids = wait_for(lambda: started_ids(logs), 120, "both nodes with --port 0 to start", tmp_path)

    def both_paired():
        rows = [peer(boot, tail) for tail in ids]
        return all(trains(row) and row["partner_rounds"] >= 1 for row in rows)

    wait_for(both_paired, 240, "both --port 0 nodes to train and average with each other", tmp_path)
    assert not any(PORT_LINE.search(log.read_text(errors="replace")) for log in logs)
    stop(shell, 30.0)
    print(f"--port 0: both trained and paired ({', '.join(ids)})")

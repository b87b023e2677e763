"""MB/s of one bulk transfer between two nodes, against raw TCP on the same path in the
same run: over libp2p streams (through both p2pd daemons) and over a direct lane
(swarm_node/net/lanes.py: plain TCP on loopback, TLS 1.3 between hosts), each with a
plain body (as activations travel) and a paced one (outer payloads, net/pacing.py).
Paths: loopback, and two hosts of the test bed (network namespaces joined by veth
pairs and a bridge) unshaped and with both access links shaped by ``tc tbf`` to
1 Gbit/s and 10 Gbit/s.

    .venv/bin/python -m bench.transport [--full]

Quick: 40 MB, 21 rounds; full: 200 MB, 9 rounds. A round is one transfer each way, so
the ways take turns and meet the machine in the same state.
Raw TCP is one Python stream with blocking sockets (the physical anchor: what one
process can push through the path)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT
from bench.common.results import Result, run_mode
from bench.transport.peer import WAYS
from bench.transport.report import markdown, plot

__all__ = ["main", "markdown", "run"]

NAME = "transport"
PEER = [sys.executable, "-m", "bench.transport.peer"]


def _pair(prefix_server: list[str], prefix_client: list[str], server_host: str, client_host: str,
          megabytes: float,
          repeats: int, log_dir: Path) -> dict:
    """Starts the serving side, measures from the other, stops both."""
    err = open(log_dir / "transport-serve.log", "ab")
    server = subprocess.Popen([*prefix_server, *PEER, "serve", "--host", server_host], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the serving peer did not start: see {log_dir / 'transport-serve.log'}")
        measured = subprocess.run([*prefix_client, *PEER, "measure", "--host", client_host, "--to", line,
                                   "--megabytes", str(megabytes), "--repeats", str(repeats)], cwd=ROOT,
                                  capture_output=True, text=True, timeout=1800)
        if measured.returncode != 0:
            raise RuntimeError(f"measuring failed: {measured.stderr[-3000:]}")
        return json.loads(measured.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        err.close()


def _add_rows(result: Result, path: str, link_mbit: float | None, measured: dict) -> None:
    """MB/s: the median transfer's. Of raw TCP: the median over rounds of raw TCP's time
    over this way's in the same round (the ways take turns, round by round)."""
    mb = measured["bytes"] / 1e6
    rates = {way: mb / statistics.median(measured[way]) for way, _ in WAYS}
    for way, label in WAYS:
        of_raw = statistics.median(raw / t for raw, t in zip(measured["raw_tcp"], measured[way]))
        result.add(path=path, link_mbit=link_mbit, way=label, megabytes=mb, mb_s=round(rates[way], 1),
                   of_raw=round(of_raw, 3),
                   of_link=None if link_mbit is None else round(rates[way] * 8 / link_mbit, 3),
                   seconds=[round(t, 4) for t in measured[way]])


def _fault_ms(n: int, huge: bool) -> float:
    """Milliseconds to bring ``n`` fresh bytes into memory, as a received body must be:
    raw TCP's sink reuses one buffer and pays none of it."""
    import mmap

    from swarm_node.net.lane_io import _huge_buffer

    times = []
    for _ in range(3):
        started = time.perf_counter()
        buffer = _huge_buffer(n) if huge else bytearray(n)
        view = memoryview(buffer)
        view[::4096] = b"\1" * len(range(0, n, 4096))
        times.append((time.perf_counter() - started) * 1000)
        view.release()
        if isinstance(buffer, mmap.mmap):
            buffer.close()
    return round(statistics.median(times), 1)


def run(mode: str, out_dir: Path) -> Result:
    from swarm_node.net.lane_io import BODY_BUFFERS
    from tests.netbed import TestBed, unavailable

    result = Result(NAME, mode, out_dir)
    # One transfer to the next varies 2x on these cores (raw TCP's own 40 MB: 23-54 ms in
    # one run), so the median of each round's ratio needs a score of rounds to settle.
    megabytes, repeats = (200.0, 9) if mode == "full" else (40.0, 21)
    started = time.monotonic()
    logs = Path(tempfile.mkdtemp(prefix="bench-transport-"))  # the serving side's stderr, if it fails
    _add_rows(result, "loopback", None, _pair([], [], "127.0.0.1", "127.0.0.1", megabytes, repeats, logs))
    reason = unavailable()
    if reason:
        result.note(f"namespaces unavailable here ({reason}): loopback only")
    else:
        with TestBed("tpb", mtu=1500) as bed:
            a, b = bed.add_host("a"), bed.add_host("b")
            for rate in (None, 10_000.0, 1_000.0):
                if rate is not None:
                    bed.shape(a, rate)
                    bed.shape(b, rate)
                label = "two hosts (veth, unshaped)" if rate is None else f"two hosts, {rate / 1000:g} Gbit/s"
                measured = _pair(["ip", "netns", "exec", a.namespace], ["ip", "netns", "exec", b.namespace],
                                 a.address, b.address, megabytes, repeats, logs)
                _add_rows(result, label, rate, measured)
        result.note(
            "links: veth pairs through a bridge, MTU 1500; shaped with tc tbf on both ends of each access "
            "link (bursts of 10 ms, 50 ms of queue): tbf on veth holds 1 and 10 Gbit/s as set, the CPUs "
            "(2 cores for both peers, their daemons and the shaping) set the pace above that"
        )
    lane = {r["path"]: r for r in result.rows if r["way"] == "direct lane"}
    p2p = {r["path"]: r for r in result.rows if r["way"] == "libp2p stream"}
    result.summary = {f"{path}: direct lane / raw TCP": lane[path]["of_raw"] for path in lane}
    result.summary.update({f"{path}: direct lane / libp2p": round(lane[path]["mb_s"] / p2p[path]["mb_s"], 2)
                           for path in lane})
    size = int(megabytes * 1e6)
    result.summary["fresh_body_ms"] = {"4 KiB pages": _fault_ms(size, False),
                                       "huge pages": _fault_ms(size, True)}
    result.note(
        f"a lane reads a body into memory that holds it (raw TCP's sink reuses one 4 MiB buffer): up to "
        f"{BODY_BUFFERS.max_kept_bytes >> 20} MiB the same buffers transfer after transfer, above that "
        f"fresh memory: {megabytes:g} MB took {result.summary['fresh_body_ms']['4 KiB pages']:.0f} ms to "
        f"fault in as a bytearray here and {result.summary['fresh_body_ms']['huge pages']:.0f} ms in "
        "transparent huge pages (what a lane takes); a lane between hosts also encrypts and decrypts every "
        "byte (TLS 1.3, AES-GCM) on the same 2 cores"
    )
    result.note(
        f"{megabytes:g} MB a transfer, {repeats} rounds of one transfer each way after one that opens the "
        f"connections (MB/s: the median transfer's; of raw TCP: the median of each round's ratio); "
        f"{time.monotonic() - started:.0f} s in all"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    run_mode(__doc__.split("\n\n")[0], run, plot, argv)
    return 0

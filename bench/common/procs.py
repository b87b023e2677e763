"""Child processes of the benchmarks: started in their own session, always stopped.

Every process a benchmark starts here is stopped on the way out, also on errors and
time-outs: first SIGTERM to the process itself (``swarm-node local`` then stops the
nodes it started, which live in sessions of their own), then SIGKILL to its whole
process group (a hivemind peer's DHT child and libp2p daemon are in it)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


class ChildFailed(RuntimeError):
    """A child exited with an error or ran past its time; the message has its log tail."""


def spawn(cmd: Sequence[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log_path, "wb") as out:
        return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, up to ``grace_s`` to exit, then SIGKILL to the process group."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever is left of its group
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def log_tail(log_path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def wait_all(processes: Sequence[subprocess.Popen], logs: Sequence[Path], deadline: float) -> None:
    """Wait for every process until the monotonic ``deadline``; ChildFailed when one
    fails or the deadline passes (the caller stops the rest)."""
    for process, log_path in zip(processes, logs):
        try:
            code = process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise ChildFailed(f"{log_path.name} ran past its time limit:\n{log_tail(log_path)}") from None
        if code != 0:
            raise ChildFailed(f"{log_path.name} exited with {code}:\n{log_tail(log_path)}")


def run_to_end(cmd: Sequence[str], timeout_s: float, log_path: Path, env: dict | None = None) -> None:
    """Run ``cmd`` to completion within ``timeout_s``; it is stopped in any case."""
    process = spawn(cmd, log_path, env)
    try:
        wait_all([process], [log_path], time.monotonic() + timeout_s)
    finally:
        stop(process)


def unwind_on_sigterm() -> None:
    """SIGTERM as an exit that unwinds: the ``with`` blocks that own children, pools and
    test beds (network namespaces) clean up on the way out, as for Ctrl-C. Without it a
    benchmark stopped by ``timeout`` left its hosts' nodes running."""
    signal.signal(signal.SIGTERM, _exit_for_signal)


def _exit_for_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)

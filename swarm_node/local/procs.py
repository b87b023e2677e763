"""The node processes of ``swarm-node local``: what became of each one, stopping them, and
sweeping up whatever a run started and left running.

A node ends in one of three ways:

- ``finished``: it exited 0 (stage 0 after its steps; the others when told to stop);
- ``dead``: it exited non-zero or was killed while the run was training, not by the
  chaos plan: out of memory (exit 2 with the one-line message), a crash, ``kill -9``
  from outside. A dead node is named in the log and the summary, and the run fails;
- ``lost``: the chaos plan killed it on purpose, or it did not stop cleanly when the
  run stopped it at the end. Neither is a failure of the run."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from swarm_node.net.reaper import daemon_sockets, descendants, remove_if_unused

log = logging.getLogger("swarm_node.local")

__all__ = ["Child", "daemon_sockets", "reap_group", "remove_stale_sockets", "stop_children",
           "sweep_descendants"]


@dataclass
class Child:
    stage: int
    replica: int
    process: subprocess.Popen
    log_path: Path
    returncode: int | None = None
    status: str = "running"  # running, finished, dead or lost (the module's docstring)
    restarted: bool = False  # started again from its checkpoint after being killed
    killed_on_purpose: bool = False  # by the chaos plan
    error: str | None = None  # the last line of its log, when it did not finish

    def name(self) -> str:
        return f"stage {self.stage} replica {self.replica} (pid {self.process.pid})"

    def death(self) -> str:
        """One line: who died, how, and the last thing it said."""
        return f"{self.name()} died with exit code {self.returncode}: {self.error or 'no output'}"

    def ended(self, code: int, *, stopping: bool) -> None:
        """It exited with ``code``; ``stopping``: after the run told it to stop."""
        self.returncode = code
        if code == 0:
            self.status = "finished"
            return
        self.error = last_line(self.log_path)
        if self.killed_on_purpose or stopping:
            self.status = "lost"
            log.warning("node %s ended with exit code %d%s", self.name(), code,
                        " (chaos)" if self.killed_on_purpose else f" when stopped: {self.error[:200]}")
        else:
            self.status = "dead"
            log.error("node %s", self.death()[:400])


def last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def poll(children: list[Child], *, stopping: bool = False) -> None:
    """Note every child that exited since the last poll; what it left of its group goes."""
    for child in children:
        if child.returncode is None:
            code = child.process.poll()
            if code is not None:
                child.ended(code, stopping=stopping)
                reap_group(child.process.pid)


def stop_children(children: list[Child], grace_s: float) -> None:
    """SIGTERM whoever is still running, SIGKILL (their whole group) after ``grace_s``."""
    poll(children)  # deaths before the stop are deaths, not the stop's doing
    running = [c for c in children if c.process.poll() is None]
    for child in running:
        child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in running:
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("node pid %d did not stop within %.0f s of SIGTERM; killing it", child.process.pid,
                        grace_s)
            reap_group(child.process.pid)
            child.process.wait()
    poll(children, stopping=True)
    for child in children:
        reap_group(child.process.pid)


def reap_group(pgid: int) -> None:
    """A node killed hard cannot stop its DHT child or p2pd; each node runs in its own
    session, so kill whatever is left of its process group."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_stale_sockets(existing_before: set[Path]) -> None:
    """A node killed hard leaves its daemon's unix sockets behind (its reaper removes
    them too, but a whole process group killed at once takes the reaper along). Remove
    those created during this run that nothing listens on any more; anything still
    listening, such as another swarm on this machine, is left alone."""
    for path in daemon_sockets() - existing_before:
        remove_if_unused(path)


def our_processes() -> set[tuple[int, int]]:
    """(pid, start time) of every process under this one; empty where there is no /proc."""
    if not Path("/proc").is_dir():
        return set()
    return set(descendants(os.getpid()))


# Helpers of this very process that end when it does and must not be cut off before:
# torch's shared-memory manager (killed early, the interpreter aborts at exit) and
# multiprocessing's resource tracker and fork server.
OWN_HELPERS = ("torch_shm_manager", "multiprocessing.resource_tracker", "multiprocessing.forkserver")


def sweep_descendants(existing_before: set[tuple[int, int]]) -> list[int]:
    """SIGKILL every process under this one that was not there before the run: what an
    interrupted start-up or a hung shutdown left (a DHT child, a p2pd, a node's reaper).
    The whole tree is read first and then killed, so nothing re-parented escapes."""
    left = [pid for pid, start in our_processes() - existing_before if not _own_helper(pid)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return left


def _own_helper(pid: int) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True  # gone already
    return any(helper in command for helper in OWN_HELPERS)

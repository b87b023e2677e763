"""A node's child processes die with it, whatever kills it.

hivemind runs the DHT in a child process, which starts the p2pd daemon; torch may
start its shared-memory manager. When the node is killed hard (kill -9, the OOM
killer, a crashed interpreter) nothing stops them: they are re-parented to init, the
dead node's peer id keeps answering, its unix sockets stay in /tmp, and a restart with
the same --identity is refused ("already taken by another peer").

So every node starts a small reaper: its own session (Ctrl-C to the terminal's process
group does not reach it), checking twice a second that the node lives (one read of
/proc/<pid>/stat) and reading the node's process tree when the node says its tree
changed (a line on the reaper's stdin, after its DHT started) and every few seconds
besides. Reading the tree means reading every process of the machine, too dear to do
twice a second with dozens of nodes (so reapers) on a small machine. When
the node is gone the reaper stops every process it last saw under it (SIGTERM, then
SIGKILL after a grace), removes the unix sockets their command lines named, and exits.
Processes are known by pid and start time, so a reused pid is never hit. A node that
stops cleanly has stopped its children itself, and its reaper exits with nothing to do."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5
RESCAN_S = 5.0  # the tree is read this often even when the node says nothing
GRACE_S = 2.0
SOCKET_DIR = Path("/tmp")  # where hivemind puts its p2pd control sockets
SOCKET_GLOB = "hivemind-*.sock"

Process = tuple[int, int]  # (pid, start time in clock ticks since boot)


class Reaper:
    """The node's handle on its reaper process."""

    def __init__(self, process: subprocess.Popen):
        self.process = process

    def rescan(self) -> None:
        """Our process tree changed (a DHT child and p2pd started): read it now."""
        try:
            self.process.stdin.write(b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):  # the reaper is gone, or we are stopping
            pass

    def terminate(self) -> None:
        self.process.terminate()

    def wait(self) -> int:
        code = self.process.wait()
        self.process.stdin.close()
        return code


def start_reaper(pid: int | None = None) -> Reaper:
    """Watch ``pid`` (this process by default) from a process of its own."""
    return Reaper(subprocess.Popen([sys.executable, "-m", "swarm_node.net.reaper", str(pid or os.getpid())],
                                   start_new_session=True, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, close_fds=True))


def watch(pid: int, poll_s: float = POLL_S, grace_s: float = GRACE_S, rescan_s: float = RESCAN_S,
          requests: int | None = None, after_scan=lambda seen: None) -> list[Process]:
    """Until ``pid`` is gone; then stop what ran under it. Returns what had to be stopped.
    ``requests``: a file descriptor on which a line asks for the tree to be read now;
    ``after_scan(processes)`` is told what each reading found."""
    node = (pid, _start_time(pid))
    seen: dict[Process, list[str]] = {}
    next_scan = 0.0
    while _alive(node):
        if time.monotonic() >= next_scan:
            # a command line never changes
            seen = {proc: seen[proc] if proc in seen else _socket_paths(proc[0])
                    for proc in descendants(pid) if proc[0] != os.getpid()}
            next_scan = time.monotonic() + rescan_s
            after_scan(list(seen))
        if requests is None:
            time.sleep(poll_s)
        elif select.select([requests], [], [], poll_s)[0]:
            if os.read(requests, 4096):
                next_scan = 0.0
            else:  # every writer closed the pipe: nobody can ask any more
                requests = None
    left = [proc for proc in seen if _alive(proc)]
    for proc in left:
        _signal(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(proc) for proc in left) and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in left:
        _signal(proc, signal.SIGKILL)
    for paths in seen.values():
        for path in paths:
            remove_if_unused(Path(path))
    return left


def descendants(pid: int) -> list[Process]:
    """Every process under ``pid`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry))
    found, frontier = [], list(children.get(pid, []))
    while frontier:
        child = frontier.pop()
        start = _start_time(child)
        if start is not None:
            found.append((child, start))
            frontier.extend(children.get(child, []))
    return found


def daemon_sockets() -> set[Path]:
    return set(SOCKET_DIR.glob(SOCKET_GLOB))


def remove_if_unused(path: Path) -> None:
    """Remove a daemon's unix socket unless something still listens on it. Listening is
    tested by connecting: /proc/net/unix would only show sockets of our own network
    namespace, and peers in other namespaces would lose their live sockets."""
    if not _listening(path):
        path.unlink(missing_ok=True)


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # busy, no permission, time-out: not ours to judge, keep it
        return True


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def _start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return stat[2] if stat else None


def _alive(proc: Process) -> bool:
    stat = _stat(proc[0])
    return stat is not None and stat[2] == proc[1] and stat[0] != "Z"


def _signal(proc: Process, sig: int) -> None:
    if _alive(proc):
        try:
            os.kill(proc[0], sig)
        except (ProcessLookupError, PermissionError):
            pass


def _socket_paths(pid: int) -> list[str]:
    """The unix sockets a daemon was told to listen on (``-listen=/unix/tmp/...sock``)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    paths = []
    for arg in args:
        text = arg.decode(errors="replace")
        if "/unix/" in text and text.endswith(".sock"):
            paths.append(text[text.index("/unix/") + len("/unix"):])
    return paths


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node's Ctrl-C is the node's business
    watch(int(sys.argv[1]), requests=sys.stdin.fileno())

"""The parent's side of the sync-cost benchmark: start peer processes (bench/sync_cost/peer.py),
on loopback or one per network namespace, send them commands and collect their answers.

Every peer runs in its own session, so its process group (the peer, its hivemind DHT
child, its libp2p daemon, its averager) can be stopped by that group's id; ``close()``
does so for every peer, also after errors."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT
from bench.sync_cost.ipc import REPLY_MARK, SeekingBoard
from bench.sync_cost.net import Namespaces
from tests.netbed import ClosedOnFailure


class PeerFailed(RuntimeError):
    pass


class PeerProcess:
    def __init__(self, rank: int, argv: list[str], log_path: Path):
        self.rank = rank
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True)
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_replies, name=f"peer-{rank}-reader", daemon=True).start()

    def _read_replies(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(REPLY_MARK):
                self._replies.put(json.loads(line[len(REPLY_MARK):]))
        self._replies.put(None)  # the peer's stdout closed: it is gone

    def send(self, cmd: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout_s: float) -> dict:
        """The peer's next answer; one with ``ok: false`` is returned too (a failed round
        is data). A peer that is silent or gone leaves the swarm unusable: that raises."""
        try:
            answer = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise PeerFailed(
                f"peer {self.rank} did not answer within {timeout_s:.0f}s{self._log_tail()}"
            ) from None
        if answer is None:
            raise PeerFailed(f"peer {self.rank} exited (code {self.proc.poll()}){self._log_tail()}")
        return answer

    def _log_tail(self) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()[-40:]
        return ("; its log ends:\n  " + "\n  ".join(lines)) if lines else ""

    def ask_to_exit(self) -> None:
        try:
            self.send("exit")
            self.proc.stdin.close()
        except (OSError, ValueError):  # already gone
            pass

    def signal_group(self, sig: int) -> None:
        """Signal the peer's whole process group (its id is the peer's pid: its own session)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def reap(self) -> None:
        self.proc.wait()
        self._log.close()


class Swarm(ClosedOnFailure):
    """``num_peers`` peer processes, on loopback or (``namespaces`` given) one per namespace."""

    def __init__(self, num_peers: int, namespaces: Namespaces | None = None,
                 startup_timeout_s: float = 120.0):
        self.num_peers = num_peers
        self.namespaces = namespaces
        self.startup_timeout_s = startup_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="sba-sync-cost-")
        self.board_path = Path(self._tmp.name) / "seeking.board"
        SeekingBoard.create(self.board_path, num_peers)
        self.peers: list[PeerProcess] = []
        self.peer_ids: list[str] = []


    def _argv(self, rank: int, initial_peers: list[str]) -> list[str]:
        host = self.namespaces.address(rank) if self.namespaces else "127.0.0.1"
        argv = [sys.executable, "-m", "bench.sync_cost.peer", "--rank", str(rank), "--host", host,
                "--board", str(self.board_path), "--num-slots", str(self.num_peers)]
        if initial_peers:
            argv += ["--initial-peers", *initial_peers]
        return (self.namespaces.exec_prefix(rank) if self.namespaces else []) + argv

    def _spawn(self, rank: int, initial_peers: list[str]) -> PeerProcess:
        peer = PeerProcess(rank, self._argv(rank, initial_peers), Path(self._tmp.name) / f"peer{rank}.log")
        self.peers.append(peer)
        return peer

    def _wait_up(self, peer: PeerProcess, initial_peers: list[str]) -> dict:
        """A peer's ``up`` line. A daemon that fails to start on a busy machine gets one
        more try (its process group is stopped first)."""
        try:
            return peer.receive(self.startup_timeout_s)
        except PeerFailed as exc:
            print(f"peer {peer.rank} did not start, trying once more: {str(exc).splitlines()[0]}",
                  file=sys.stderr)
            self.peers.remove(peer)
            peer.signal_group(signal.SIGKILL)
            peer.reap()
            return self._spawn(peer.rank, initial_peers).receive(self.startup_timeout_s)

    def open(self) -> None:
        """Peer 0 first (everyone else bootstraps from it), then the rest at once."""
        up = [self._wait_up(self._spawn(0, []), [])]
        initial = up[0]["maddrs"]
        rest = [self._spawn(rank, initial) for rank in range(1, self.num_peers)]
        up += [self._wait_up(peer, initial) for peer in rest]
        self.peers.sort(key=lambda peer: peer.rank)
        self.peer_ids = [answer["peer_id"] for answer in up]
        self.call(range(self.num_peers), "peers", timeout_s=30, peer_ids=self.peer_ids)

    def call(self, ranks, cmd: str, timeout_s: float, **args) -> list[dict]:
        """Send the same command to ``ranks`` at once; their answers in rank order.
        Raises when any of them failed: for set-up steps, where a failure ends the run."""
        answers = self.call_each({rank: args for rank in ranks}, cmd, timeout_s)
        failed = {rank: a["error"] for rank, a in answers.items() if not a.get("ok")}
        if failed:
            raise PeerFailed(f"{cmd} failed: {failed}")
        return list(answers.values())

    def call_each(self, commands: dict[int, dict], cmd: str, timeout_s: float) -> dict[int, dict]:
        """Send each rank its own arguments for ``cmd`` at once; answers by rank, failed
        ones included (every peer answers once per command, so the lines stay in step)."""
        for rank, args in commands.items():
            self.peers[rank].send(cmd, **args)
        deadline = time.monotonic() + timeout_s
        return {rank: self.peers[rank].receive(max(1.0, deadline - time.monotonic())) for rank in commands}

    def close(self, grace_s: float = 5.0) -> None:
        """Ask every peer to exit, then stop what is left of each process group by id."""
        for peer in self.peers:
            peer.ask_to_exit()
        deadline = time.monotonic() + grace_s
        for peer in self.peers:
            try:
                peer.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the DHT child and daemons may outlive the peer
            for peer in self.peers:
                peer.signal_group(sig)
            time.sleep(0.3)
        for peer in self.peers:
            peer.reap()
        self.peers = []
        self._tmp.cleanup()

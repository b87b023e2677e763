"""The peers a bootstrap has seen, kept in a file beside its identity. A restarted
bootstrap dials them at once: its DHT starts empty, and the nodes, which redial a
bootstrap that was down, do so only every several seconds (each failure doubling the
pause). Only peers that answered the bootstrap (verified) are kept, with the addresses
their connections came from: a forged registry record puts nothing here.

The file is this machine's own, not peer input, but it may be damaged (a full disk, an
edit): what cannot be read is ignored with one line, and the bootstrap starts as if
it had no file."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from swarm_node.system import write_atomic

log = logging.getLogger("swarm_bootstrap")

MAX_PEERS = 256  # the most recently seen win
MAX_ADDRS_PER_PEER = 4
MAX_FILE_BYTES = 1 << 20


def peers_file_for(identity_path: Path) -> Path:
    """``bootstrap.key`` -> ``bootstrap.peers.json`` in the same (private) folder."""
    return identity_path.with_name(f"{identity_path.stem}.peers.json")


class KnownPeers:
    def __init__(self, path: Path):
        self.path = path
        self.peers: dict[str, list[str]] = {}  # peer id -> addresses without /p2p/, oldest first
        self._saved: dict[str, list[str]] = {}

    def load(self) -> list[str]:
        """The remembered peers as full multiaddrs (``.../p2p/<id>``), newest first."""
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("peers"), dict):
                raise ValueError("not a {'peers': {...}} object")
            self.note(data["peers"], verified=data["peers"].keys())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
            log.warning(
                "ignoring the remembered peers in %s (%s); the swarm is found through the nodes' redials",
                self.path,
                exc,
            )
            self.peers = {}
        self._saved = {p: list(a) for p, a in self.peers.items()}
        return [f"{addr}/p2p/{peer}" for peer, addrs in reversed(self.peers.items()) for addr in addrs]

    def note(self, connected: Mapping[str, Iterable[str]], verified: Iterable[str]) -> None:
        """Remember the verified peers among ``connected`` (peer id -> addresses)."""
        for peer in verified:
            addrs = connected.get(peer)
            if not isinstance(peer, str) or not isinstance(addrs, list | tuple):
                continue
            usable = [a for a in addrs if isinstance(a, str) and a.startswith("/") and "/p2p/" not in a]
            if usable:
                self.peers.pop(peer, None)  # re-inserted as the newest
                self.peers[peer] = usable[:MAX_ADDRS_PER_PEER]
        while len(self.peers) > MAX_PEERS:
            self.peers.pop(next(iter(self.peers)))

    def save(self) -> None:
        """Atomically, and only when something changed; a failure to write is one line, not a crash."""
        if self.peers == self._saved:
            return
        try:
            write_atomic(self.path, json.dumps({"peers": self.peers}), mode=0o600)
            self._saved = {p: list(a) for p, a in self.peers.items()}
        except OSError as exc:
            log.warning("could not remember the swarm's peers in %s: %s", self.path, exc)

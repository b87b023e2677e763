"""Staying connected: remember whom we were connected to; when every connection is gone
(a network blip, or every peer we knew restarted), dial the initial and remembered
peers. Initial peers we are not connected to are dialled again too, with a back-off:
a bootstrap that restarts has forgotten the swarm, and the DHT forgot it when its
calls failed; dialling it puts each of us back in its routing table."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Protocol

from swarm_node.errors import PeerError
from swarm_node.spec_record import peer_ids_of

log = logging.getLogger(__name__)

MAX_KNOWN_PEERS = 32
MAX_REDIAL_S = 10.0  # an initial peer that is down is dialled again at most this far apart (a restarted
# bootstrap that lost its peers file finds the swarm through these redials)


class Dialer(Protocol):
    peer_id: str

    async def connected_peers(self) -> dict[str, list[str]]: ...

    async def rebootstrap(self, maddrs: list[str], timeout_s: float = 10.0) -> int: ...


class Backoff:
    """Attempts spaced ``first_s``, then twice as far each failure, at most ``max_s``."""

    def __init__(self, first_s: float, max_s: float, clock: Callable[[], float] = time.monotonic):
        self.first_s, self.max_s, self.clock = first_s, max_s, clock
        self.interval_s = first_s
        self.next_at = 0.0
        self.failures = 0  # in a row

    def due(self) -> bool:
        return self.clock() >= self.next_at

    def done(self, success: bool) -> None:
        self.failures = 0 if success else self.failures + 1
        self.interval_s = self.first_s if success else min(self.max_s, 2 * self.interval_s)
        self.next_at = self.clock() + self.interval_s


class Reconnector:
    def __init__(self, dht: Dialer, initial_peers: tuple[str, ...], *, check_s: float,
                 on_failure: Callable[[str], None] = lambda what: None):
        self.dht = dht
        self.initial_peers = initial_peers
        self.check_s = check_s
        self.on_failure = on_failure  # the node's "last error"
        self.known: dict[str, list[str]] = {}  # peer -> addresses, for re-bootstrapping

    async def run(self) -> None:
        alone_checks = 0
        redial = Backoff(self.check_s, MAX_REDIAL_S, clock=asyncio.get_running_loop().time)
        initial = dict(zip(peer_ids_of(self.initial_peers), self.initial_peers))
        initial.pop(self.dht.peer_id, None)
        while True:
            await asyncio.sleep(self.check_s * random.uniform(0.8, 1.2))
            try:
                async with asyncio.timeout(5.0):
                    connected = await self.dht.connected_peers()
            except (TimeoutError, PeerError) as exc:
                log.debug("could not list connections: %s", exc)
                continue
            self._remember(connected)
            alone_checks = 0 if connected else alone_checks + 1
            if alone_checks >= 2:
                await self._rebootstrap()
                continue
            missing = [maddr for peer, maddr in initial.items() if peer not in connected]
            if connected and missing and redial.due():  # alone, the re-bootstrap above dials them
                reached = await self._redial(missing)
                if reached and redial.failures:  # it was down: worth a line
                    log.info("reconnected to %d initial peer(s) after %d failed attempts", reached,
                             redial.failures)
                redial.done(success=reached > 0)

    def _remember(self, connected: dict[str, list[str]]) -> None:
        for peer, addrs in connected.items():
            self.known.pop(peer, None)
            self.known[peer] = addrs[:4]
            while len(self.known) > MAX_KNOWN_PEERS:
                self.known.pop(next(iter(self.known)))

    async def _redial(self, maddrs: list[str]) -> int:
        try:
            return await self.dht.rebootstrap(maddrs, timeout_s=5.0)
        except (TimeoutError, PeerError) as exc:
            log.debug("re-dialling initial peers failed: %s", exc)
            return 0

    async def _rebootstrap(self) -> None:
        initial_ids = set(peer_ids_of(self.initial_peers))
        known = [f"{addr}/p2p/{peer}" for peer, addrs in self.known.items() for addr in addrs
                 if "/p2p/" not in addr and peer not in initial_ids]
        log.warning("no connection to any peer; re-bootstrapping from %d initial and %d known peers",
                    len(self.initial_peers), len(self.known))
        try:
            reached = await self.dht.rebootstrap([*self.initial_peers, *known])
        except (TimeoutError, PeerError) as exc:
            reached = 0
            log.debug("re-bootstrap failed: %s", exc)
        if reached:
            log.info("re-bootstrap: reconnected to %d peers", reached)
        else:
            self.on_failure("no peer reachable; re-bootstrapping")
            log.warning("re-bootstrap: nobody answered; trying again in %.0fs (check this machine's network)",
                        self.check_s)

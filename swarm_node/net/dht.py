"""The hivemind DHT: start-up with clear failure messages, small records with expiry,
signed records, and re-bootstrapping when every connection is gone.

Records are dictionaries keyed by subkey (one per peer), each entry expiring on its
own, which makes a natural per-stage registry. Values must stay small (a few KB).
Every DHT of ours runs hivemind's RSASignatureValidator keyed by the peer's identity,
so owner-tagged records (see net/identity.py) cannot be overwritten by others."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from hivemind import DHT
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from swarm_node.errors import ConfigError, PeerError, SwarmError
from swarm_node.net.identity import ensure_identity, owner_subkey, peer_id_of_owner, record_validator
from swarm_node.net.logs import quiet_streams_reset_before_their_header, route_hivemind_logs
from swarm_node.net.maddr import unresolved_hosts
from swarm_node.net.near import BUCKET_SIZE, NUM_REPLICAS, NUM_WORKERS, read_near, store_near
from swarm_node.net.ports import PortClaim, claim_ports

log = logging.getLogger(__name__)


UNREACHABLE_MARK = "can't access this node"
REBOOTSTRAP_DIALS_AT_ONCE = 32


@dataclass(frozen=True)
class Traversal:
    """How one kind of DHT operation walks the DHT: finds in flight, and its beam."""
    workers: int
    beam_size: int


# get(latest=True) is never satisfied early: it walks its whole beam and takes the
# dictionary from every node that holds or caches the key (measured on 16 DHT processes:
# from all 15 others, 78 kB for 4 records; bench/scale/dht_costs.py).
LATEST_GET = Traversal(NUM_WORKERS, BUCKET_SIZE)
# A get that asks only for a dictionary whose newest entry is recent stops at the first
# node holding one, the replicas being the first nodes near the key a walk reaches;
# one find at a time, so finds already in flight do not bring more copies. The registry
# reads this way only where net/near.py cannot: it asks a remembered replica at random.
FRESH_GET = Traversal(1, BUCKET_SIZE)
# A store's walk is made of finds, and a find answers with the key's dictionary: with
# hivemind's beam of 20 a store downloaded the dictionary from every holder on its way
# (97 kB to store one 1 kB entry beside 3 others). A beam of the replicas it needs visits
# those (and what leads to them): Kademlia's answers name each node's nearest to the key,
# so the walk still ends at the key's nearest nodes. One find at a time: a heartbeat can
# wait a few round trips, and finds in flight beside it would each bring a copy too.
# net/near.py walks so once a key and then stores to the replicas it found directly;
# hivemind's store is the fallback.
STORE = Traversal(1, NUM_REPLICAS)
# hivemind's cache_nearest=1 makes every get that found something newer than its own
# cached copy upload the whole dictionary to one more node near the key (0.5-0.7 uploads
# a get measured); reads that stop at the first fresh copy, which the replicas hold,
# gain nothing from extra copies.
CACHE_NEAREST = 0


@dataclass(frozen=True)
class Signed:
    """A signed entry's value and when the DHT drops it, in wall-clock seconds (hivemind's
    DHT time). The expiry is the writer's claim: readers bound it (membership/registry.py)."""
    value: object
    expires_at_s: float


def _forget_parent_signal_handlers() -> None:
    """Runs in every child forked from this process; hivemind's DHT process is one. It
    would inherit the parent's asyncio signal handlers, which swallow SIGTERM: then
    hivemind's hard stop (terminate) cannot stop it, and the parent hangs at exit
    joining it. Ctrl-C reaches the whole process group; the parent stops the child."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):  # not the main thread of the child: nothing was inherited there
        pass


@dataclass
class DhtOps:
    """What a peer asked of the DHT for the registry, counted so that a real run can be
    held against the swarm-scale simulator's (swarm_node/scale), which counts the same."""
    gets: int = 0
    entries_read: int = 0  # signed entries the gets returned
    stores: int = 0
    # how (net/near.py): gets answered by a replica asked directly, and the finds they
    # made; gets and stores that fell back to hivemind's walk
    near_gets: int = 0
    near_finds: int = 0
    walked_gets: int = 0
    walked_stores: int = 0
    get_s: float = 0.0  # seconds the gets took, summed
    store_s: float = 0.0

    @contextmanager
    def timing(self, kind: str, clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
        """Adds the time the block takes to ``<kind>_s`` (get or store), failed or not."""
        started = clock()
        try:
            yield
        finally:
            setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + clock() - started)


os.register_at_fork(after_in_child=_forget_parent_signal_handlers)
route_hivemind_logs()  # every program that talks to peers starts here


class SwarmDHT:
    def __init__(self, dht: DHT, validator, throwaway_dir: Path | None = None, client_mode: bool = False,
                 start_kwargs: dict | None = None, ports: PortClaim | None = None):
        self.dht = dht
        self.peer_id = str(dht.peer_id)
        self.client_mode = client_mode
        self._owner = owner_subkey(validator)
        self._throwaway_dir = throwaway_dir
        self._start_kwargs = start_kwargs or {}
        self._ports = ports or PortClaim()  # our fixed listening ports, claimed until shutdown (net/ports.py)
        self._p2p: P2P | None = None
        self.ops = DhtOps()
        self.answered_by: Counter[str] = Counter()  # peer id -> the gets it answered directly (net/near.py)

    @classmethod
    async def start(cls, *, initial_peers: Sequence[str] = (),
                    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
                    announce_maddrs: Sequence[str] = (), identity_path: str | None = None,
                    client_mode: bool = False, startup_timeout_s: float = 60.0) -> SwarmDHT:
        """Start the DHT. Without ``identity_path`` the peer gets a throwaway identity
        (deleted at shutdown). When the initial peers cannot call this peer back, it
        falls back to client mode with relays by itself and says so."""
        ports = claim_ports(host_maddrs)  # before the daemon starts: one peer per port, whatever the timing
        throwaway_dir = None
        try:
            if identity_path is None:
                throwaway_dir = Path(tempfile.mkdtemp(prefix="swarm-identity-"))
                identity_path = str(throwaway_dir / "identity.key")
            await asyncio.to_thread(ensure_identity, identity_path)
            validator = record_validator(identity_path)
            kwargs = dict(initial_peers=list(initial_peers), host_maddrs=list(host_maddrs), start=True,
                          startup_timeout=startup_timeout_s, identity_path=identity_path,
                          record_validators=[validator], check_if_identity_free=throwaway_dir is None,
                          cache_nearest=CACHE_NEAREST)
            if announce_maddrs:
                kwargs["announce_maddrs"] = list(announce_maddrs)
            try:
                dht = await _start_dht_patiently(kwargs, client_mode, initial_peers, startup_timeout_s)
            except _Unreachable:
                log.warning("the initial peers cannot open connections to this node (a NAT or firewall is in "
                            "the way); continuing in client mode through relays: this node trains, but "
                            "slower. To fix it, forward a port and pass --host-maddrs /ip4/0.0.0.0/tcp/PORT "
                            "--announce-maddrs /ip4/PUBLIC_IP/tcp/PORT")
                client_mode = True
                dht = await _start_dht(kwargs, True, initial_peers, startup_timeout_s)
        except BaseException:
            ports.release()
            if throwaway_dir is not None:
                shutil.rmtree(throwaway_dir, ignore_errors=True)
            raise
        return cls(dht, validator, throwaway_dir, client_mode, kwargs, ports)

    async def restart_in_client_mode(self) -> None:
        """Start again, same identity, as a DHT client behind relays: for a node others
        cannot dial (its peers would keep trying to, and time out, if it served the DHT).
        Whoever replicated the old P2P client must replicate again."""
        await self._close_replica()
        await self._stop_child()
        initial_peers = self._start_kwargs.get("initial_peers", ())
        timeout_s = self._start_kwargs.get("startup_timeout", 60.0)
        # the identity is free: it was ours a moment ago, and the peers may not have noticed yet
        kwargs = dict(self._start_kwargs, check_if_identity_free=False)
        self.dht = await _start_dht(kwargs, True, initial_peers, timeout_s)
        self.client_mode = True

    def is_alive(self) -> bool:
        """hivemind runs the DHT in a child process; it can die under us (OOM killer, kill)."""
        return self.dht.is_alive()

    def wall_now(self) -> float:
        """The clock entries' expiries are on (hivemind's DHT time: the wall clock)."""
        return get_dht_time()

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def replicate_p2p(self) -> P2P:
        if self._p2p is None:
            quiet_streams_reset_before_their_header(asyncio.get_running_loop())
            self._p2p = await self.dht.replicate_p2p()
        return self._p2p

    async def connected_peers(self) -> dict[str, list[str]]:
        """Peers the daemon holds a connection to, with their addresses."""
        p2p = await self.replicate_p2p()
        try:
            infos = await p2p.list_peers()
        except (P2PDaemonError, ConnectionError, OSError) as exc:
            raise PeerError(f"the libp2p daemon did not list its connections: {exc}") from None
        return {str(info.peer_id): [str(a) for a in info.addrs] for info in infos}

    async def rebootstrap(self, maddrs: Sequence[str], timeout_s: float = 10.0) -> int:
        """Reconnect to the given peers (full multiaddrs with /p2p/) and put them back
        into the DHT's routing table; returns how many answered."""
        p2p = await self.replicate_p2p()
        by_peer: dict[str, list[Multiaddr]] = {}
        for text in maddrs:
            try:
                maddr = Multiaddr(text)
                by_peer.setdefault(maddr["p2p"], []).append(maddr.decapsulate(f"/p2p/{maddr['p2p']}"))
            except (ValueError, KeyError, TypeError):
                log.debug("skipping unusable multiaddr %s", text)
        connecting = asyncio.Semaphore(REBOOTSTRAP_DIALS_AT_ONCE)

        async def connect(peer: str, addrs: list[Multiaddr]) -> str | None:
            async with connecting:
                try:
                    async with asyncio.timeout(timeout_s):
                        await p2p._client.connect(PeerID.from_base58(peer), addrs)
                    return peer
                except (TimeoutError, P2PDaemonError, ConnectionError, OSError, ValueError) as exc:
                    log.debug("re-bootstrap: %s did not answer: %s", peer[-6:], exc)
                    return None

        # at once: one dead peer's time-out must not hold up the rest
        answered = await asyncio.gather(*(connect(peer, addrs) for peer, addrs in by_peer.items()
                                          if peer != self.peer_id))
        reached = [peer for peer in answered if peer is not None]
        if reached:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.dht.run_coroutine(partial(_ping_into_routing_table, reached),
                                                 return_future=True)
            except (TimeoutError, RuntimeError, OSError) as exc:  # a dead DHT process; the caller retries
                raise PeerError(f"the DHT did not take the reconnected peers: {exc}") from None
        return len(reached)

    async def store(self, key: str, subkey: str, value, ttl_s: float) -> bool:
        return bool(await self.dht.store(key, value, get_dht_time() + ttl_s, subkey=subkey,
                                         return_future=True, beam_size=STORE.beam_size,
                                         num_workers=STORE.workers))

    async def store_signed(self, key: str, value, ttl_s: float) -> bool:
        """Store under our owner subkey: only this peer's key can write that entry."""
        self.ops.stores += 1
        with self.ops.timing("store"):
            expiry = get_dht_time() + ttl_s
            stored, _ = await self.dht.run_coroutine(partial(store_near, key=key, subkey=self._owner,
                                                             value=value,
                                                             expiration=expiry), return_future=True)
            if stored is not None:
                return stored
            self.ops.walked_stores += 1
            return await self.store(key, self._owner, value, ttl_s)

    async def get_signed(self, key: str, sufficient_expiry_s: float | None = None) -> dict[str, Signed]:
        """Owner-tagged entries of ``key`` by the peer id whose key signed them (the
        validator has checked each signature); untagged entries are ignored. The latest
        the DHT holds, or (``sufficient_expiry_s``, wall clock) the first copy found whose
        newest entry expires then or later."""
        signed = {}
        with self.ops.timing("get"):
            found = await self.get_subkeys(key, sufficient_expiry_s)
        for subkey, entry in found.items():
            signer = peer_id_of_owner(subkey)
            if signer is not None:
                signed[signer] = entry
        self.ops.gets += 1
        self.ops.entries_read += len(signed)
        return signed

    async def get_subkeys(self, key: str, sufficient_expiry_s: float | None = None) -> dict[str, Signed]:
        """Live entries of a dictionary record (expired ones are dropped by the DHT)."""
        if sufficient_expiry_s is None:
            found = await self.dht.get(key, latest=True, return_future=True)
        else:
            found, finds, source = await self.dht.run_coroutine(partial(read_near, key=key,
                                                                sufficient_expiry=sufficient_expiry_s),
                                                        return_future=True)
            self.ops.near_finds += finds
            if found is not None:
                self.ops.near_gets += 1
                self.answered_by[source] += 1
            else:
                self.ops.walked_gets += 1
                found = await self.dht.get(key, sufficient_expiration_time=sufficient_expiry_s,
                                           num_workers=FRESH_GET.workers, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(sub): Signed(entry.value, float(entry.expiration_time))
                for sub, entry in found.value.items()
                if hasattr(entry, "value") and hasattr(entry, "expiration_time")}

    async def shutdown(self) -> None:
        """Stop the DHT process and forget a throwaway identity."""
        try:
            await self._close_replica()
            await self._stop_child()
        finally:
            self._ports.release()
            if self._throwaway_dir is not None:
                shutil.rmtree(self._throwaway_dir, ignore_errors=True)

    async def _close_replica(self) -> None:
        """Closed on the loop: left to the garbage collector, hivemind's P2P.__del__ asks
        for an event loop in whichever thread collects it, and raises in any but ours."""
        if self._p2p is not None:
            replica, self._p2p = self._p2p, None
            await replica.shutdown()

    async def _stop_child(self) -> None:
        """Runs on a daemon thread: if the child is wedged and the caller gives up
        waiting, the thread must not keep this process from exiting."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def stop() -> None:
            try:
                self.dht.shutdown()
            finally:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        threading.Thread(target=stop, name="dht-shutdown", daemon=True).start()
        await done


class _Unreachable(Exception):
    pass


class _InitialPeersSilent(SwarmError):
    pass


FIRST_RETRY_S, LONGEST_RETRY_S = 2.0, 15.0


async def _start_dht_patiently(kwargs: dict, client_mode: bool, initial_peers: Sequence[str],
                               timeout_s: float) -> DHT:
    """Start the DHT; while the initial peers do not answer its pings but one of them
    accepts TCP connections, try again (backing off) until ``timeout_s``. hivemind gives a
    ping 3 s: a bootstrap on a busy machine (32 nodes starting at once beside it) or
    behind a slow link can miss that and still be up. A port nobody listens on is an
    error at once: a wrong address is said without waiting."""
    loop = asyncio.get_running_loop()
    deadline, wait_s = loop.time() + timeout_s, FIRST_RETRY_S
    while True:
        try:
            return await _start_dht(kwargs, client_mode, initial_peers, timeout_s)
        except _InitialPeersSilent as exc:
            if loop.time() + wait_s > deadline or not await asyncio.to_thread(_any_port_listening,
                                                                              initial_peers):
                names = await asyncio.to_thread(unresolved_hosts, initial_peers)
                if names:
                    raise _InitialPeersSilent(f"{exc}; {', '.join(names)} does not resolve here: check "
                                              "the host name, or give the bootstrap's IP address") from None
                raise
            log.warning("the initial peers did not answer in time although one accepts connections (busy?); "
                        "trying again in %.0f s", wait_s)
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, LONGEST_RETRY_S)


def _any_port_listening(maddrs: Sequence[str], timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to any /ip4|ip6/.../tcp/PORT multiaddr is accepted."""
    for text in maddrs:
        parts = text.strip("/").split("/")
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or not parts[3].isdigit():
            continue
        try:
            with socket.create_connection((parts[1], int(parts[3])), timeout=timeout_s):
                return True
        except OSError:
            continue
    return False


async def _start_dht(kwargs: dict, client_mode: bool, initial_peers: Sequence[str], timeout_s: float) -> DHT:
    extra = dict(client_mode=True, use_relay=True,
                 use_auto_relay=True) if client_mode else dict(client_mode=False)
    try:
        # DHT() blocks while its child process and p2pd start: keep the loop free.
        return await asyncio.to_thread(DHT, **kwargs, **extra)
    except Exception as exc:  # hivemind raises bare Exceptions for all of these
        if UNREACHABLE_MARK in str(exc) and not client_mode:
            raise _Unreachable() from None
        raise _explain_start_failure(exc, initial_peers, timeout_s) from None


async def _ping_into_routing_table(peer_ids: list[str], _dht, node) -> None:
    """Runs inside the DHT process (hence a module-level function: it is pickled)."""
    await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(p)) for p in peer_ids))


def _explain_start_failure(exc: Exception, initial_peers: Sequence[str], timeout_s: float) -> SwarmError:
    text = str(exc)
    if ("none of the initial_peers responded" in text or "bootstrap failed" in text
            or "failed to connect to bootstrap peers" in text):
        return _InitialPeersSilent(
            f"none of the initial peers answered ({', '.join(initial_peers) or 'none given'}); "
            "check the multiaddrs (including the /p2p/ id), that the peer is up, "
            "and that its port is reachable from here"
        )
    if "local time must be within" in text:
        return SwarmError(
            "this machine's clock differs from the initial peer's by more than 3 s, and the DHT "
            "refuses that: turn on time synchronisation (e.g. `timedatectl set-ntp true`)"
        )
    if "failed to start in" in text:
        return SwarmError(
            f"the libp2p daemon did not start within {timeout_s:.0f}s; "
            "try again with a larger --startup-timeout (slow disks and busy machines need more)"
        )
    if "already taken" in text:
        return ConfigError(f"{text}; another process uses this identity file: give each node its own")
    return SwarmError(f"could not start the DHT: {text}")

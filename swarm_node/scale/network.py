"""The modelled internet between simulated peers: links with latency and rate, peers that
crash or sit behind a NAT, and the DHT's registry, with every byte of control traffic
counted against the peer that sent or received it.

What is modelled, and how:

- A message from a to b takes the pair's one-way delay (half the mean of their access
  round trips) plus its size over min(a's uplink, b's downlink). Links do not contend:
  payloads at once on one uplink each get the whole rate, which flatters the exchange
  times of busy peers a little and does not touch pairing or control traffic.
- A call to a crashed peer, or to one behind a NAT, gets no answer: the caller waits out
  its own deadline (a dial that is never answered).
- The DHT (hivemind's Kademlia) as costs and delays, not as a routing table: a stored
  entry becomes visible after a delay and expires at its TTL; a get returns what is
  visible under the key. Its bytes follow what hivemind 1.1.12 does (DhtCosts says how
  it was checked): a get or a store walks the DHT with find RPCs, and every find that
  reaches a node holding the key (one of its ``replicas`` nearest nodes, or a node that
  read it lately and still caches it) comes back with the key's whole dictionary, a
  store's find too. Readers and stores count what they send and receive; the nodes
  asked count what they serve.
- The registry's fresh reads and heartbeats as net/near.py makes them: a peer that has
  met a key before (read it, or stored to it within RELEARN_S) knows its replicas and
  reads from one of them at random, one find, or stores to them with no walk. A cold
  read approaches the key (finds spread over the swarm) and then asks a random replica;
  a cold store walks as hivemind's does. Not modelled: a remembered replica that has
  crashed (the real read loses one find's time-out to it and asks another), and copies
  that differ between replicas. The sizes of a signed entry are hivemind's own (an RSA
  owner key and signature around the record's msgpack).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import math
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgpack

from swarm_node.errors import PeerTimeout
from swarm_node.gossip.pairing import now as loop_now  # the running loop's clock: virtual here
from swarm_node.net.dht import (
    CACHE_NEAREST,
    FRESH_GET,
    LATEST_GET,
    NUM_REPLICAS,
    STORE,
    DhtOps,
    Signed,
    Traversal,
)
from swarm_node.net.near import RELEARN_S

OWNER_KEY_BYTES = 391  # "[owner:ssh-rsa ...]", msgpack'd: the subkey of every signed entry
SIGNATURE_BYTES = 356  # "[signature:...]" appended to the value
ENTRY_FRAMING_BYTES = 24  # expiry and protobuf framing


@dataclass(frozen=True)
class DhtCosts:
    """What hivemind 1.1.12's DHT moves for a get or a store, checked two ways.

    Its code (hivemind/dht/node.py, traverse.py): ``get(latest=True)`` asks for an
    expiry of infinity, so ``_SearchState`` is never satisfied and ``traverse_dht`` runs
    until it has visited the ``beam_size`` (bucket_size, 20) nearest nodes it knows of;
    ``rpc_find`` answers with the key's whole dictionary wherever it sits in storage
    *or cache*, and every reader caches what it found (``cache_locally``) and pushes it
    to one more node (``cache_nearest=1``); a store walks the same way
    (``find_nearest_nodes``, beam max(bucket_size, num_replicas)) with the same finds,
    so it downloads the dictionary from every holder it passes, and then sends its
    entry to the ``num_replicas`` (5) nearest. A find's answer names up to 20 nodes.

    Measured (bench/scale/dht_costs.py, 16 real DHT processes with the RSA validator,
    4 signed records of 258 msgpack bytes under one key, protobuf bytes of every RPC):
    a find request 46 B, 50.4 B a node named in its answer, a signed entry 1024 B in a
    find's answer; in the steady state (every node had read the key) a latest get made
    15 finds and got the dictionary from all 15 (77.7 kB, 0.67 cache pushes), a cold
    one from the 5 replicas (35.9 kB); a store 97 kB (18.3 finds, each with the
    dictionary, and 5 stores of about 85 B plus the entry). This model gives 76.6 kB,
    34.7 kB and 79 kB there. The previous figures (3 responders, 700 B a find, about
    9 finds, no dictionary in a store's finds) understated a get 2-4x and a store 8x."""
    replicas: int = NUM_REPLICAS
    find_request_bytes: int = 46
    neighbour_bytes: float = 50.4  # one node named in a find's answer (DHTID and PeerID)
    neighbours: int = 20  # bucket_size: how many a find's answer names
    store_rpc_bytes: int = 85  # a store RPC around its entry
    # cache_nearest=1 (hivemind's default): the share of gets that push what they found
    # to one more node (0.5-0.67 measured); the node runs without (CACHE_NEAREST)
    cache_push_share: float = 0.6 if CACHE_NEAREST else 0.0
    # how the registry's gets and stores walk (the node's choices, swarm_node/net/dht.py)
    get: Traversal = LATEST_GET
    fresh_get: Traversal = FRESH_GET
    store: Traversal = STORE

    def approach_finds(self, live: int, workers: int) -> int:
        """Finds before a walk reaches the key's neighbourhood: a caller's routing table
        already knows nodes that close in a few hundred nodes; each 20-fold more nodes
        cost about one more hop, ``workers`` finds at once."""
        return workers * max(0, math.ceil(math.log(max(live, 2)) / math.log(self.neighbours)) - 1)

    def find_bytes(self, live: int) -> float:
        return self.find_request_bytes + self.neighbour_bytes * min(self.neighbours, live - 1)


def entry_bytes(value: dict) -> int:
    return len(msgpack.packb(value)) + OWNER_KEY_BYTES + SIGNATURE_BYTES + ENTRY_FRAMING_BYTES


@dataclass
class Traffic:
    """One peer's control bytes, in and out, by kind."""
    bytes_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, n: int) -> None:
        self.bytes_by_kind[kind] += n

    @property
    def total(self) -> int:
        return sum(self.bytes_by_kind.values())


@dataclass
class Endpoint:
    """What the network knows of a peer."""
    peer_id: str
    rtt_s: float
    uplink_bps: float
    downlink_bps: float
    reachable: bool
    alive: bool = True
    on_reached: Callable[[str], None] = lambda peer: None  # a caller proved its id by calling (the guard's)
    handlers: dict[str, Callable[[str, bytes], Awaitable[bytes]]] = field(default_factory=dict)
    authorize: dict[str, Callable[[str], bool]] = field(default_factory=dict)
    traffic: Traffic = field(default_factory=Traffic)


class Network:
    def __init__(self, rng: random.Random, costs: DhtCosts, record_delay_s: tuple[float, float],
                 modelled_bytes: Callable[[str, bool, int], int], op_s: dict[str,
                                                                             float | None] | None = None):
        self.rng = rng
        self.costs = costs
        self.record_delay_s = record_delay_s
        # "get" / "store" -> measured mean seconds, instead of the lookup's round trips
        self.op_s = op_s or {}
        self.modelled_bytes = modelled_bytes  # (protocol, is_request, actual bytes) -> bytes the model moves
        self.endpoints: dict[str, Endpoint] = {}
        # key -> peer -> versions (value, visible_at, expires_at), on the loop's clock: the
        # one readers see and the one spreading
        self.store: dict[str, dict[str, list[tuple[dict, float, float]]]] = defaultdict(dict)
        # key -> peer caching its dictionary -> until (loop clock)
        self.caches: dict[str, dict[str, float]] = {}
        # peer -> key -> when it last learned the replicas
        self.met: dict[str, dict[str, float]] = defaultdict(dict)
        self._holders: dict[str, list[str]] = {}  # key -> the live peers nearest it
        self._node_ids: dict[str, int] = {}
        # live endpoints, kept as they come and go (counting them was a third of a run's time)
        self._live_count = 0

    # -- peers ---------------------------------------------------------------------
    def add(self, endpoint: Endpoint) -> None:
        if (old := self.endpoints.get(endpoint.peer_id)) is not None and old.alive:
            self._live_count -= 1
        self.endpoints[endpoint.peer_id] = endpoint
        self._live_count += endpoint.alive
        self._holders.clear()

    def crash(self, peer_id: str) -> None:
        endpoint = self.endpoints[peer_id]
        self._live_count -= endpoint.alive
        endpoint.alive = False
        self._holders.clear()

    def one_way_s(self, a: Endpoint, b: Endpoint) -> float:
        return (a.rtt_s + b.rtt_s) / 4

    def transfer_s(self, sender: Endpoint, receiver: Endpoint, n: int) -> float:
        return self.one_way_s(sender, receiver) + n * 8 / min(sender.uplink_bps, receiver.downlink_bps)

    # -- streams ---------------------------------------------------------------------
    async def request(self, caller: str, peer: str, protocol: str, payload: bytes, timeout_s: float,
                      count_as: str | None, on_sent: Callable[[float], None] | None = None) -> bytes:
        """One call, as net/transport.py's: the answer, or PeerTimeout at the deadline."""
        me, them = self.endpoints[caller], self.endpoints.get(peer)
        try:
            async with asyncio.timeout(timeout_s):
                if them is None or not them.alive or not them.reachable or protocol not in them.handlers:
                    await asyncio.sleep(timeout_s + 1.0)  # never answered: the deadline ends it
                sent_s = self.transfer_s(me, them, self.modelled_bytes(protocol, True, len(payload)))
                await asyncio.sleep(sent_s)
                if on_sent is not None:
                    on_sent(sent_s)
                if not them.alive or not them.authorize[protocol](caller):
                    await asyncio.sleep(timeout_s + 1.0)
                them.on_reached(caller)
                if count_as:
                    me.traffic.add(count_as, len(payload))
                    them.traffic.add(count_as, len(payload))
                answer = await them.handlers[protocol](caller, payload)
                await asyncio.sleep(self.transfer_s(them, me,
                                                    self.modelled_bytes(protocol, False, len(answer))))
                if not them.alive:
                    await asyncio.sleep(timeout_s + 1.0)
                if count_as:
                    me.traffic.add(count_as, len(answer))
                    them.traffic.add(count_as, len(answer))
                return answer
        except TimeoutError:
            raise PeerTimeout(f"{protocol} to {peer[-6:]}: no answer in {timeout_s:.1f}s") from None

    async def instant_call(self, caller: str, peer: str, protocol: str, request: bytes, answer: bytes,
                           timeout_s: float) -> bytes:
        """A call whose handler answers ``answer`` at once and keeps no state (a forward's
        trip, as modelled): one timer for the round trip, where ``request`` takes a
        deadline and a timer each way (forwards were half of a large run's events)."""
        me, them = self.endpoints[caller], self.endpoints.get(peer)
        trip_s = timeout_s
        if (them is not None and them.alive and them.reachable and protocol in them.handlers
                and them.authorize[protocol](caller)):
            trip_s = (self.transfer_s(me, them, self.modelled_bytes(protocol, True, len(request)))
                      + self.transfer_s(them, me, self.modelled_bytes(protocol, False, len(answer))))
        await asyncio.sleep(min(trip_s, timeout_s))
        if trip_s >= timeout_s or not them.alive:  # never answered, or crashed meanwhile
            await asyncio.sleep(max(0.0, timeout_s - trip_s))
            raise PeerTimeout(f"{protocol} to {peer[-6:]}: no answer in {timeout_s:.1f}s")
        them.on_reached(caller)
        return answer

    # -- the DHT -------------------------------------------------------------------
    def holders(self, key: str) -> list[str]:
        """The live peers nearest the key's hash: where its entries are stored."""
        return self._nearest(key)[:self.costs.replicas]

    def _nearest(self, key: str) -> list[str]:
        """The live peers nearest the key's hash, as many as a walk's beam can visit (and
        one more, for a caller among them)."""
        if key not in self._holders:
            target = int.from_bytes(hashlib.sha1(key.encode()).digest(), "big")
            beam = max(self.costs.get.beam_size, self.costs.fresh_get.beam_size, self.costs.store.beam_size,
                       self.costs.replicas) + 1
            self._holders[key] = heapq.nsmallest(
                beam,
                (p for p, e in self.endpoints.items() if e.alive),
                key=lambda p: self._node_ids.setdefault(p, _node_id(p)) ^ target,
            )
        return self._holders[key]

    def _lookup_s(self, caller: Endpoint, op: str) -> float:
        """How long finding a key's replicas from ``caller`` takes, for a get or store."""
        if self.op_s.get(op) is not None:
            return self.op_s[op] * self.rng.uniform(0.5, 1.5)
        hops = max(1, math.ceil(math.log2(max(self._live(), 2)) / math.log2(20)) + 1)
        return hops * caller.rtt_s * self.rng.uniform(1.0, 2.0)

    def _live(self) -> int:
        return self._live_count

    def _visible(self, key: str, now: float) -> dict[str, tuple[dict, float]]:
        """peer -> (value, expiry) of the entries a reader sees under ``key`` now."""
        visible = {}
        for peer, versions in self.store.get(key, {}).items():
            seen = [(value, expires) for value, visible_at,
                    expires in versions if visible_at <= now < expires]
            if seen:
                visible[peer] = seen[-1]
        return visible

    def _walk(self, caller: str, key: str, way: Traversal, now: float,
              enough: Callable[[str], bool] = lambda peer: False) -> tuple[int, list[str]]:
        """(finds, the nodes whose find answered with the key's dictionary) of one walk
        from ``caller``: the approach, then the key's nearest nodes, nearest first, until
        ``enough`` (a get satisfied early; the finds already in flight still answer) or
        the beam is visited."""
        live = self._live()
        finds = self.costs.approach_finds(live, way.workers)
        holders, cached = set(self.holders(key)), self.caches.get(key, {})
        answered, stop_at = [], None
        for i, node in enumerate(p for p in self._nearest(key) if p != caller):
            if i >= way.beam_size or (stop_at is not None and i >= stop_at):
                break
            finds += 1
            if node in holders or cached.get(node, 0.0) > now:
                answered.append(node)
                if stop_at is None and enough(node):
                    stop_at = i + way.workers
        return finds, answered

    async def dht_store(self, caller: str, key: str, value: dict, ttl_s: float) -> bool:
        me = self.endpoints[caller]
        seconds = self._lookup_s(me, "store")
        now = asyncio.get_running_loop().time()
        live = self._live()
        if now - self.met[caller].get(key, -math.inf) <= RELEARN_S:
            finds, answered = 0, []  # straight to the replicas it knows
        else:
            finds, answered = self._walk(caller, key, self.costs.store, now)
            self.met[caller][key] = now
        dictionary = sum(entry_bytes(v) for v, _ in self._visible(key, now).values())
        size = entry_bytes(value)
        replicas = [h for h in self.holders(key) if h != caller]  # the entry goes to each
        me.traffic.add("dht-lookup", finds * self.costs.find_bytes(live))
        me.traffic.add("dht-store", len(answered) * dictionary
                       + (size + self.costs.store_rpc_bytes) * len(replicas))
        for node in answered:
            self.endpoints[node].traffic.add("dht-serving", dictionary)
        for holder in replicas:
            self.endpoints[holder].traffic.add("dht-serving", size + self.costs.store_rpc_bytes)
        self._serve_finds(caller, key, finds, live)
        await asyncio.sleep(seconds)
        now = asyncio.get_running_loop().time()
        versions = [v for v in self.store[key].get(caller, []) if v[2] > now]
        # the entry stored before stays visible until this one has spread
        self.store[key][caller] = [*versions[-1:],
                                   (value, now + self.rng.uniform(*self.record_delay_s), now + ttl_s)]
        return True

    def _near_read(self, caller: str, key: str, live: int, enough: Callable[[str], bool]) -> list[str] | None:
        """A read as net/near.py makes it: [] where the caller holds a fresh copy itself,
        [the replica asked] where it holds one, None where no replica does (the caller
        walks then)."""
        holders = self.holders(key)
        if caller in holders:
            return [] if enough(caller) else None
        replica = self.rng.choice(holders)
        return [replica] if enough(replica) else None

    def _serve_finds(self, caller: str, key: str, finds: int, live: int) -> None:
        """The nodes a walk asked answer a find each (the approach's are spread over the swarm)."""
        nearest = [p for p in self._nearest(key) if p != caller]
        for i in range(finds):
            node = nearest[i] if i < len(nearest) else self.rng.choice(nearest)
            self.endpoints[node].traffic.add("dht-serving", self.costs.find_bytes(live))

    async def dht_get(self, caller: str, key: str, wall_now: Callable[[], float],
                      sufficient_expiry_s: float | None = None) -> dict[str, Signed]:
        """What ``key`` holds: the latest (``sufficient_expiry_s`` None), or the first
        dictionary found whose newest entry expires at ``sufficient_expiry_s`` (wall
        clock) or later."""
        me = self.endpoints[caller]
        await asyncio.sleep(self._lookup_s(me, "get"))
        loop_now = asyncio.get_running_loop().time()
        wall_offset = wall_now() - loop_now
        visible = self._visible(key, loop_now)
        newest = max((expires for _, expires in visible.values()), default=0.0)
        cached = self.caches.setdefault(key, {})
        if sufficient_expiry_s is None:
            way, enough = self.costs.get, (lambda node: False)
        else:
            threshold = sufficient_expiry_s - wall_offset
            way = self.costs.fresh_get

            def enough(node: str) -> bool:
                return (newest if node in self.holders(key) else cached.get(node, 0.0)) >= threshold
        live = self._live()
        found = {peer: Signed(value, wall_offset + expires) for peer, (value, expires) in visible.items()}
        near = self._near_read(caller, key, live, enough) if sufficient_expiry_s is not None else None
        if near == []:  # its own copy
            return found
        if near:  # one find at the replica; a cold read approaches the key first
            finds, answered = 1 + self.costs.approach_finds(live, 1) * (key not in self.met[caller]), near
        else:
            finds, answered = self._walk(caller, key, way, loop_now, enough)
        dictionary = sum(entry_bytes(v) for v, _ in visible.values())
        me.traffic.add("dht-lookup", finds * self.costs.find_bytes(live))
        me.traffic.add("dht-get", len(answered) * dictionary)
        for node in answered:
            self.endpoints[node].traffic.add("dht-serving",
                                             dictionary + (self.costs.find_bytes(live) if near else 0))
        if near:  # a cold read's approach: finds spread over the nodes around the key, replicas among them
            for _ in range(finds - 1):
                self.endpoints[self.rng.choice(self._nearest(key))].traffic.add("dht-serving",
                                                                                 self.costs.find_bytes(live))
            self.met[caller][key] = loop_now  # the answer names the replicas
        else:
            self._serve_finds(caller, key, finds, live)
        if visible and newest > cached.get(caller, 0.0):  # cache_locally; and cache_nearest pushes it on
            cached[caller] = newest
            if self.rng.random() < self.costs.cache_push_share:
                target = next((p for p in self._nearest(key) if p != caller), None)
                if target is not None:
                    me.traffic.add("dht-get", dictionary)
                    self.endpoints[target].traffic.add("dht-serving", dictionary)
                    cached[target] = max(cached.get(target, 0.0), newest)
        return found


def _node_id(peer_id: str) -> int:
    return int.from_bytes(hashlib.sha1(peer_id.encode()).digest(), "big")


class SimDHT:
    """What Membership needs of a DHT, for one simulated peer."""

    def __init__(self, network: Network, peer_id: str, wall_now: Callable[[], float]):
        self.network = network
        self.peer_id = peer_id
        self._wall_now = wall_now
        self.ops = DhtOps()

    def is_alive(self) -> bool:
        return self.network.endpoints[self.peer_id].alive

    def wall_now(self) -> float:
        return self._wall_now()

    async def store_signed(self, key: str, value: dict, ttl_s: float) -> bool:
        self.ops.stores += 1
        with self.ops.timing("store", loop_now):
            return await self.network.dht_store(self.peer_id, key, value, ttl_s)

    async def get_signed(self, key: str, sufficient_expiry_s: float | None = None) -> dict[str, Signed]:
        with self.ops.timing("get", loop_now):
            found = await self.network.dht_get(self.peer_id, key, self._wall_now, sufficient_expiry_s)
        self.ops.gets += 1
        self.ops.entries_read += len(found)
        return found


class SimTransport:
    """The calling and serving sides of net/transport.py for one simulated peer."""

    def __init__(self, network: Network, peer_id: str, control: Callable[[str], str | None],
                 on_answer: Callable[[str, bytes], None] = lambda protocol, answer: None):
        self.network = network
        self.peer_id = peer_id
        self.control = control  # protocol -> the traffic kind it counts as (None: data, not counted)
        self.on_answer = on_answer

    async def request(self, peer: str, protocol: str, payload: bytes, *, timeout_s: float,
                      max_response_bytes: int, paced_request: bool = False, paced_response: bool = False,
                      on_sent: Callable[[float], None] | None = None) -> bytes:
        answer = await self.network.request(self.peer_id, peer, protocol, payload, timeout_s,
                                            self.control(protocol), on_sent)
        self.on_answer(protocol, answer)
        return answer

    async def serve(self, protocol: str, handler, limits, authorize=lambda remote: True, *,
                    with_address: bool = False) -> None:
        endpoint = self.network.endpoints[self.peer_id]

        async def bounded(remote: str, request: bytes) -> bytes:
            async with asyncio.timeout(limits.handler_timeout_s):
                return await handler(remote, request)

        endpoint.handlers[protocol] = bounded
        endpoint.authorize[protocol] = authorize

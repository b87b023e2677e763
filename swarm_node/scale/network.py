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
- The DHT (hivemind's Kademlia) as costs and delays, not as a routing table: a store or
  a get takes a lookup of ``lookup_rpcs(N)`` round trips; a stored entry becomes visible
  after a delay and expires at its TTL; a get returns what is visible under the key. Its
  bytes: each lookup RPC, the entries each replica sends back (a get answers with the
  whole dictionary of the key, from ``get_responders`` replicas), the entry to each of
  ``replicas`` replicas for a store; the replicas (the peers nearest the key's hash)
  count what they receive and send. The sizes of a signed entry are hivemind's own
  (an RSA owner key and signature around the record's msgpack); the RPC figures are
  estimates that the 32-process run measures.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgpack

from swarm_node.errors import PeerTimeout
from swarm_node.net.dht import DhtOps, Signed

OWNER_KEY_BYTES = 391  # "[owner:ssh-rsa ...]", msgpack'd: the subkey of every signed entry
SIGNATURE_BYTES = 356  # "[signature:...]" appended to the value
ENTRY_FRAMING_BYTES = 24  # expiry and protobuf framing


@dataclass(frozen=True)
class DhtCosts:
    replicas: int = 5  # hivemind's num_replicas
    get_responders: int = 3  # replicas that answer a get with the key's dictionary (latest=True asks on)
    lookup_rpc_bytes: int = 700  # one find RPC: request, and an answer naming the nearest peers

    def lookup_rpcs(self, total_peers: int) -> int:
        """Kademlia with k = 20 buckets: about log2(N) / log2(k) + 1 hops, each asking a
        few peers at once."""
        return 3 * max(1, math.ceil(math.log2(max(total_peers, 2)) / math.log2(20)) + 1)


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
                 modelled_bytes: Callable[[str, bool, int], int], op_s: dict[str, float | None] | None = None):
        self.rng = rng
        self.costs = costs
        self.record_delay_s = record_delay_s
        self.op_s = op_s or {}  # "get" / "store" -> measured mean seconds, instead of the lookup's round trips
        self.modelled_bytes = modelled_bytes  # (protocol, is_request, actual bytes) -> bytes the model moves
        self.endpoints: dict[str, Endpoint] = {}
        # key -> peer -> versions (value, visible_at, expires_at), on the loop's clock: the
        # one readers see and the one spreading
        self.store: dict[str, dict[str, list[tuple[dict, float, float]]]] = defaultdict(dict)
        self._holders: dict[str, list[str]] = {}

    # -- peers ---------------------------------------------------------------------
    def add(self, endpoint: Endpoint) -> None:
        self.endpoints[endpoint.peer_id] = endpoint
        self._holders.clear()

    def crash(self, peer_id: str) -> None:
        self.endpoints[peer_id].alive = False
        self._holders.clear()

    def one_way_s(self, a: Endpoint, b: Endpoint) -> float:
        return (a.rtt_s + b.rtt_s) / 4

    def transfer_s(self, sender: Endpoint, receiver: Endpoint, n: int) -> float:
        return self.one_way_s(sender, receiver) + n * 8 / min(sender.uplink_bps, receiver.downlink_bps)

    # -- streams ---------------------------------------------------------------------
    async def request(self, caller: str, peer: str, protocol: str, payload: bytes, timeout_s: float,
                      count_as: str | None) -> bytes:
        """One call, as net/transport.py's: the answer, or PeerTimeout at the deadline."""
        me, them = self.endpoints[caller], self.endpoints.get(peer)
        try:
            async with asyncio.timeout(timeout_s):
                if them is None or not them.alive or not them.reachable or protocol not in them.handlers:
                    await asyncio.sleep(timeout_s + 1.0)  # never answered: the deadline ends it
                await asyncio.sleep(self.transfer_s(me, them, self.modelled_bytes(protocol, True, len(payload))))
                if not them.alive or not them.authorize[protocol](caller):
                    await asyncio.sleep(timeout_s + 1.0)
                them.on_reached(caller)
                if count_as:
                    me.traffic.add(count_as, len(payload))
                    them.traffic.add(count_as, len(payload))
                answer = await them.handlers[protocol](caller, payload)
                await asyncio.sleep(self.transfer_s(them, me, self.modelled_bytes(protocol, False, len(answer))))
                if not them.alive:
                    await asyncio.sleep(timeout_s + 1.0)
                if count_as:
                    me.traffic.add(count_as, len(answer))
                    them.traffic.add(count_as, len(answer))
                return answer
        except TimeoutError:
            raise PeerTimeout(f"{protocol} to {peer[-6:]}: no answer in {timeout_s:.1f}s") from None

    # -- the DHT -------------------------------------------------------------------
    def holders(self, key: str) -> list[str]:
        """The live peers nearest the key's hash: where its entries are stored."""
        if key not in self._holders:
            target = int.from_bytes(hashlib.sha1(key.encode()).digest(), "big")
            live = [p for p, e in self.endpoints.items() if e.alive]
            self._holders[key] = sorted(live, key=lambda p: int.from_bytes(hashlib.sha1(p.encode()).digest(), "big")
                                        ^ target)[:self.costs.replicas]
        return self._holders[key]

    def _lookup(self, caller: Endpoint, op: str) -> tuple[float, int]:
        """(seconds, bytes) of finding a key's replicas from ``caller`` for a get or store."""
        rpcs = self.costs.lookup_rpcs(sum(e.alive for e in self.endpoints.values()))
        if self.op_s.get(op) is not None:
            return self.op_s[op] * self.rng.uniform(0.5, 1.5), rpcs * self.costs.lookup_rpc_bytes
        hops = max(1, rpcs // 3)
        return hops * caller.rtt_s * self.rng.uniform(1.0, 2.0), rpcs * self.costs.lookup_rpc_bytes

    async def dht_store(self, caller: str, key: str, value: dict, ttl_s: float) -> bool:
        me = self.endpoints[caller]
        seconds, lookup_bytes = self._lookup(me, "store")
        size = entry_bytes(value)
        me.traffic.add("dht-lookup", lookup_bytes)
        me.traffic.add("dht-store", size * self.costs.replicas)
        for holder in self.holders(key):
            self.endpoints[holder].traffic.add("dht-serving", size + self.costs.lookup_rpc_bytes // 2)
        await asyncio.sleep(seconds)
        now = asyncio.get_running_loop().time()
        versions = [v for v in self.store[key].get(caller, []) if v[2] > now]
        # the entry stored before stays visible until this one has spread
        self.store[key][caller] = [*versions[-1:], (value, now + self.rng.uniform(*self.record_delay_s), now + ttl_s)]
        return True

    async def dht_get(self, caller: str, key: str, wall_now: Callable[[], float]) -> dict[str, Signed]:
        me = self.endpoints[caller]
        seconds, lookup_bytes = self._lookup(me, "get")
        await asyncio.sleep(seconds)
        now = asyncio.get_running_loop().time()
        visible = {}
        for peer, versions in self.store.get(key, {}).items():
            seen = [(value, expires) for value, visible_at, expires in versions if visible_at <= now < expires]
            if seen:
                value, expires = seen[-1]
                visible[peer] = Signed(value, wall_now() + (expires - now))
        answer = sum(entry_bytes(v.value) for v in visible.values())
        me.traffic.add("dht-lookup", lookup_bytes)
        me.traffic.add("dht-get", answer * self.costs.get_responders)
        holders = self.holders(key)
        for holder in holders[:self.costs.get_responders]:
            self.endpoints[holder].traffic.add("dht-serving", answer + self.costs.lookup_rpc_bytes // 2)
        return visible


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
        started = asyncio.get_running_loop().time()
        try:
            return await self.network.dht_store(self.peer_id, key, value, ttl_s)
        finally:
            self.ops.timed("store", started, asyncio.get_running_loop().time())

    async def get_signed(self, key: str) -> dict[str, Signed]:
        started = asyncio.get_running_loop().time()
        try:
            found = await self.network.dht_get(self.peer_id, key, self._wall_now)
        finally:
            self.ops.timed("get", started, asyncio.get_running_loop().time())
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

    async def request(self, peer: str, protocol: str, payload: bytes, *, timeout_s: float, max_response_bytes: int,
                      paced_request: bool = False, paced_response: bool = False) -> bytes:
        answer = await self.network.request(self.peer_id, peer, protocol, payload, timeout_s, self.control(protocol))
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

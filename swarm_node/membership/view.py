"""Who is in the run as this node sees it, and this node's own place in it.

The node heartbeats its record into the per-stage registry (membership/registry.py),
reads the records of the stages it works with, keeps those it can use (signed, of
this run's spec, allowed on a closed run), picks its stage when it joins, and
re-publishes the run spec so the run can be joined through any node."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from swarm_node.errors import SwarmError
from swarm_node.gossip.pairing import PAST_HALF, SEEKING_NOW, UNLIKELY
from swarm_node.membership.reachability import Reachability
from swarm_node.membership.registry import Cadence, Entries, publish_record, read_shard, read_stage
from swarm_node.membership.stages import assign_stage, rebalanced_stage
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.guard import PeerGuard
from swarm_node.node_config import NodeConfig
from swarm_node.spec import RunSpec
from swarm_node.spec_record import SPEC_REPUBLISH_S, publish_spec
from swarm_node.wire.records import PeerRecord

log = logging.getLogger(__name__)

STAGE_SETTLE_PASSES = 3  # looks at the joiners' announced stages before taking one for good
JOIN_SHARDS = 4  # shards of each stage a joiner reads to count the stages (of a sharded registry)
ENDED_SHARDS = 8  # shards read to tell whether a stage has ended
READ_DEADLINE_S = 10.0  # at least; a registry read of the sharded cadence may take 5 polls
SLOW_DHT_LOG_S = 60.0


class Membership:
    def __init__(self, *, spec: RunSpec, dht: SwarmDHT, guard: PeerGuard, config: NodeConfig,
                 record: Callable[[], PeerRecord]):
        self.spec = spec
        self.spec_hash = spec.spec_hash()
        self.dht = dht
        self.guard = guard
        self.config = config
        self.record = record  # what our heartbeat publishes (the node puts it together)
        self.stage: int | None = None
        self.state = "joining"  # joining, training, finished, leaving: as our record says
        self.reachability: Reachability | None = None  # what peers measured dialling us back
        # what we know of each stage, without expired records
        self.peers: dict[int, dict[str, PeerRecord]] = {}
        self.shards = spec.registry_shards
        self.cadence = Cadence.for_shards(self.shards, config.heartbeat_s, config.registry_poll_s,
                                          config.record_ttl_s)
        self._reads = 0  # registry reads so far: a sharded registry reads our stage and the next in turn
        self._entries: dict[int, Entries] = {}  # stage -> peer -> (record, expiry): the view, shard by shard
        self._next_shard: dict[int, int] = {}  # stage -> the shard the next read takes
        self._seen_live_s: dict[int, float] = {}  # stage -> when a read last showed a live peer in it
        self._slow_ops, self._slow_logged_at = 0, None  # DHT operations past their deadline, not yet logged

    @property
    def own_id(self) -> str:
        return self.dht.peer_id

    @property
    def reachable(self) -> bool:
        """False once peers tried to dial us back and could not (unknown counts as reachable)."""
        return self.reachability is None or self.reachability.reachable is not False

    def live_peers(self, stage: int) -> dict[str, PeerRecord]:
        return {p: r for p, r in self.peers.get(stage, {}).items() if r.state == "training"}

    def callable_peers(self, stage: int) -> dict[str, PeerRecord]:
        """Live peers we can open streams to: routing, pairing proposals and state
        downloads go only there (a peer behind a NAT calls out, and is never called)."""
        return {p: r for p, r in self.live_peers(stage).items() if r.reachable}

    def next_stage_peers(self) -> dict[str, PeerRecord]:
        """Where our micro-batches can go."""
        return self.callable_peers(self.stage + 1)

    def partner_candidates(self) -> list[tuple[str, int]]:
        """Peers of our stage we may propose to, each with how likely it accepts now
        (gossip/pairing.py: seeking, past half of its round, or neither). Verified peers
        and at most one unverified one (net/guard.py). What a record says is a claim:
        believed of verified peers only, so a probe of a forged record (they all claim
        to seek) comes after the peers we know are seeking, not in their place (in a
        multi-host run, rounds spent proposing to forged peers stopped the stage's compute)."""
        peers = self.callable_peers(self.stage)
        half = self.spec.method.inner_steps // 2
        candidates = []
        for peer in self.guard.probe_set(list(peers), random):
            record, likely = peers[peer], UNLIKELY
            if self.guard.is_verified(peer):
                likely = (
                    SEEKING_NOW if record.seeking else PAST_HALF if record.round_step >= half else UNLIKELY
                )
            candidates.append((peer, likely))
        return candidates

    def callers_expected(self) -> bool:
        """Peers of our stage that nobody can call only ever call us: keep rounds open
        for those we know exist (they called us before)."""
        return any(not r.reachable and self.guard.is_verified(p) and not self.guard.is_banned(p)
                   for p, r in self.live_peers(self.stage).items())

    async def stage_has_ended(self, stage: int, timeout_s: float = 10.0) -> bool:
        """No peer of ``stage`` has trained or joined for a whole record lifetime (they
        finished, left, or their records expired): for a later stage deciding whether
        the run it was given --max-steps for is over. One read is not enough: a DHT
        lookup can come back without some or all of a stage's records while they live,
        and one such read ended a stage-1 node in the middle of a run. A read that times
        out says nothing."""
        clock = asyncio.get_running_loop().time
        now = clock()
        last_live_s = self._seen_live_s.setdefault(stage, now)
        try:
            async with asyncio.timeout(timeout_s):
                parsed, _ = await read_stage(self.dht, self.spec.run_id, stage, self.shards,
                                             max_shards=ENDED_SHARDS)
        except TimeoutError:
            return False
        if any(r.state in ("training", "joining") and r.spec_hash == self.spec_hash
               for peer, r in parsed.items() if peer != self.own_id):
            self._seen_live_s[stage] = clock()
            return False
        return now - last_live_s >= self.cadence.ttl_s

    def steps_behind(self, inner_step: int) -> int:
        """How far the most advanced live peer of our stage is ahead of ``inner_step``."""
        ahead = max((r.inner_step for r in self.live_peers(self.stage).values()), default=0)
        return max(0, ahead - inner_step)

    # -- reading the registry ------------------------------------------------------
    async def refresh(self, all_stages: bool = False) -> None:
        """Read our stage and the next (or every stage), keeping the records we can use.
        One shard of each per read (a few, for every stage); records of shards not read
        this time stay until they expire."""
        if all_stages or self.stage is None:
            stages = range(self.spec.num_stages)
        else:
            stages = sorted({self.stage, min(self.stage + 1, self.spec.num_stages - 1)})
            if self.cadence.alternate_stages:
                stages = [stages[self._reads % len(stages)]]
        self._reads += 1
        for stage in stages:
            for shard in self._shards_to_read(stage, JOIN_SHARDS if all_stages else 1):
                found, unreadable = await read_shard(self.dht, self.spec.run_id, stage, shard, self.shards,
                                                     self.cadence.sufficient_expiry_s(self.dht.wall_now()))
                for peer, exc in unreadable.items():
                    self.guard.ignore(peer, f"registry record refused: {exc}", reason="bad-record")
                self._merge(stage, self._usable(stage, found))
            self._expire(stage)

    def _shards_to_read(self, stage: int, count: int) -> list[int]:
        """The next ``count`` shards of ``stage`` in turn (from a random one), so a view
        covers the stage every ``shards`` reads."""
        start = self._next_shard.setdefault(stage, random.randrange(self.shards))
        count = min(count, self.shards)
        self._next_shard[stage] = (start + count) % self.shards
        return [(start + i) % self.shards for i in range(count)]

    def _usable(self, stage: int, found: Entries) -> Entries:
        usable = {}
        for peer, (record, expires_at_s) in found.items():
            if peer == self.own_id:
                continue
            if not self.spec.admits(peer):
                self.guard.ignore(peer, "not on this closed run's list of allowed peers", reason="bad-record")
                continue
            if record.spec_hash != self.spec_hash:
                self.guard.ignore(peer,
                                  f"run-spec hash {record.spec_hash} differs from ours ({self.spec_hash})",
                                  reason="bad-record")
                continue
            if record.stage == stage:
                usable[peer] = (record, expires_at_s)
        return usable

    def _merge(self, stage: int, found: Entries) -> None:
        """What a read found joins what we hold; a peer it did not return stays until its
        record expires. A DHT read merges the entries of the replicas that answered in
        time, so on a busy machine or link it returns part of a key: a view replaced by
        each read would see only a few of its stage's peers.
        A peer that leaves says so in its record; one that crashed leaves no sooner
        either way, since its record stays in the DHT until it expires."""
        entries = self._entries.setdefault(stage, {})
        for peer, (record, expires_at_s) in found.items():
            # one record a peer, over every stage: the one that expires last (a joiner that
            # moved leaves its withdrawn guess under the old stage until that expires)
            held = [(s, e[1]) for s, held_entries in self._entries.items() if (e := held_entries.get(peer))]
            if any(held_expiry > expires_at_s for _, held_expiry in held):
                continue
            for other, _ in held:
                del self._entries[other][peer]
                if other != stage:
                    self._expire(other)
            entries[peer] = (record, expires_at_s)

    def _expire(self, stage: int) -> None:
        entries = self._entries.get(stage, {})
        now = self.dht.wall_now()
        for peer in [p for p, (_, expires_at_s) in entries.items() if expires_at_s <= now]:
            del entries[peer]
        self.peers[stage] = {peer: record for peer, (record, _) in entries.items()}

    async def registry_loop(self, after_each: Callable[[], Awaitable[None]] | None = None) -> None:
        while True:
            await asyncio.sleep(self.cadence.poll_s * random.uniform(0.8, 1.2))
            try:
                # A read the DHT is slow to answer still brings the peers it found: cut it
                # off late (on a busy machine many reads take seconds)
                async with asyncio.timeout(max(READ_DEADLINE_S, self.cadence.poll_s * 5)):
                    await self.refresh()
            except TimeoutError:
                self._slow_dht("registry read")
            if after_each is not None:
                await after_each()

    def _slow_dht(self, what: str) -> None:
        """A DHT operation ran past its deadline: said at most once a minute, with a count."""
        self._slow_ops += 1
        now = asyncio.get_running_loop().time()
        if self._slow_logged_at is None or now - self._slow_logged_at >= SLOW_DHT_LOG_S:
            log.warning(
                "%s timed out (%d DHT operations past their deadline since the last such line): the DHT "
                "answers slowly (a busy machine or link)",
                what,
                self._slow_ops,
            )
            self._slow_ops, self._slow_logged_at = 0, now

    # -- publishing ------------------------------------------------------------------
    async def heartbeat(self) -> None:
        if not self.dht.is_alive():
            raise SwarmError("the DHT process died, so this node can no longer find peers; "
                             "restart it (if the machine is short of memory, that is the likely cause)")
        try:
            async with asyncio.timeout(self.cadence.heartbeat_s * 2):
                await publish_record(self.dht, self.spec.run_id, self.record(), ttl_s=self.cadence.ttl_s,
                                     shards=self.shards)
        except TimeoutError:
            self._slow_dht("registry heartbeat")

    async def round_changed(self) -> None:
        """A round opened (we seek) or closed: published now where the cadence says so
        (a one-key registry), else with the next heartbeat."""
        if self.cadence.announce_rounds:
            await self.heartbeat()

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cadence.heartbeat_s * random.uniform(0.8, 1.2))
            await self.heartbeat()

    async def publish_loop(self) -> None:
        """Every node re-publishes the spec it follows, signed, so the run can be joined
        through any of its nodes, also once every bootstrap peer is gone."""
        while True:
            await asyncio.sleep(SPEC_REPUBLISH_S * random.uniform(0.8, 1.2))
            try:
                async with asyncio.timeout(10.0):
                    await publish_spec(self.dht, self.spec)
            except TimeoutError:
                log.warning("gave up re-publishing the run spec after 10s")
            except (SwarmError, OSError) as exc:
                log.debug("re-publishing the run spec failed: %s", exc)

    # -- joining ----------------------------------------------------------------------
    async def pick_stage(self) -> int:
        """Balance peers over stages, also when several join at once: announce a first
        guess, give simultaneous joiners time to announce theirs, then take this
        node's place in an assignment every joiner computes the same way; then even
        out while the stages as announced differ by two or more (membership/stages.py)."""
        self.stage = assign_stage(self.peers, self.own_id, self.spec.num_stages, self.reachable)
        await self.heartbeat()  # state "joining": visible to the others
        for settle in range(STAGE_SETTLE_PASSES):
            await asyncio.sleep(self.cadence.poll_s * 2 * random.uniform(1.0, 1.5))
            await self.refresh(all_stages=True)
            if settle == 0:
                chosen = assign_stage(self.peers, self.own_id, self.spec.num_stages, self.reachable)
            else:
                chosen = rebalanced_stage(self.peers, self.own_id, self.stage, self.spec.num_stages,
                                          self.reachable)
            if chosen == self.stage and settle > 0:
                break
            if chosen != self.stage:
                log.info("taking stage %d instead of %d: other peers joined at the same time", chosen,
                         self.stage)
                self.state = "leaving"  # withdraw the guess at once rather than at record expiry
                await self.heartbeat()
                self.state = "joining"
                self.stage = chosen
                await self.heartbeat()
        return self.stage

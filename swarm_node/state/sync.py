"""State transfer for late joiners and nodes that fell behind (protocol
``/swarm-node/state/3.0.0``).

A donor answers chunk requests from one consistent snapshot of theta, phi, the outer
momentum and its counters, coded for the wire (wire/state_codec.py: 7.1 bytes a
parameter, not fp32's 20) and cached for a few minutes under the snapshot's digest and
shared by every caller within its outer round (so callers can neither make it hold
more than MAX_SNAPSHOTS copies nor fill the cache against a joiner); each chunk served
renews it, up to a cap from its size at the floor rate. The joiner picks donors at
random among the live peers of its stage, fetches the chunks with a progress bar,
giving a donor up by a stall rule (net/stalls.py: no chunk for ``stall_s``, or more than
``stall_s`` behind ``min_bytes_per_s``) and at that cap, decoding each chunk as it arrives, checks the
digest over everything it received (the coded tensors), then asks the stage's other
peers for sketches of their states (state/witnesses.py) and adopts the state only if
they vouch for it (state/check.py); on any failure or refusal it tries the next donor,
and bans a refused donor only when the check says an honest majority disowns it. The
inner optimizer's moments come too (the inner state is never averaged, but a joiner is
a copy of its donor: with fresh moments its Deltas are several times its partners',
refused as poisoned); no witness vouches for them, so they are held to what any Adam
could have made (InnerOptimizer.moments_problem)."""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from swarm_node.errors import PeerError, PeerRefused, PeerTimeout, ProtocolError
from swarm_node.net import protocols
from swarm_node.net.exists import answers_status
from swarm_node.net.stalls import Flow, Stalled, StallRule
from swarm_node.net.transport import ServeLimits, short_id
from swarm_node.node_services import NodeServices
from swarm_node.state.check import Verdict, check_state
from swarm_node.state.sketch import StateSketch, sketch_state
from swarm_node.state.witnesses import MAX_WITNESSES, Witnesses
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.messages import MAX_SKETCH_SEED, check_state_chunk, check_state_counters
from swarm_node.wire.records import PeerRecord
from swarm_node.wire.state_codec import StateDecoder, TensorDigest, encoded_snapshot, wire_bytes_cap

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
SNAPSHOT_TTL_S = 120.0  # an idle snapshot (no chunk served) is dropped this long after its last chunk
MAX_SNAPSHOTS = 4
# A snapshot is shared with every caller that starts a download within its outer round and
# this long after it was made: one a round at most, and never one a round stale.
SHARE_S = SNAPSHOT_TTL_S / MAX_SNAPSHOTS
MAX_DONORS = 4
# A joiner gives a donor up when no chunk came for STALL_S, or when it fell more than
# STALL_S behind MIN_BYTES_PER_S (1 Mbit/s: a 4 MiB chunk in 34 s); a whole download is
# cut at its size at that rate plus STALL_S, and a donor keeps a snapshot no longer.
STALL_S = 60.0
MIN_BYTES_PER_S = 1e6 / 8
CHUNK_RETRIES = 2  # a chunk whose stream broke is asked again (same donor, same snapshot)
RETRY_S = 2.0
CHECK_TIMEOUT_S = 120.0  # asking the stage's other replicas to vouch for a downloaded state
PROBE_TIMEOUT_S = 5.0  # a status request: a few hundred bytes
MAX_PROBES = 64  # peers asked at once whether they exist before a download


class StateSync:
    """Both sides of a state transfer for one stage: ``handle`` serves donors' chunks,
    ``download`` fetches a snapshot from a random live peer of the stage ahead of us and
    adopts it once the others vouch for it."""

    def __init__(self, *, worker: StageWorker, services: NodeServices, spec_hash: str,
                 donors: Callable[[], dict[str, PeerRecord]], witnesses: Witnesses,
                 stall_s: float | None = None, min_bytes_per_s: float | None = None,
                 progress: bool = True, prefer: str | None = None,
                 clock: Callable[[], float] | None = None, rng: random.Random | None = None):
        self.worker = worker
        self.witnesses = witnesses  # the other replicas' sketches of their states
        self.prefer = prefer  # a donor to ask first (--state-from); its state is checked like any other
        self.rng = rng or random.Random()
        self.compute, self.transport, self.guard, self.stats = (services.compute, services.transport,
                                                                services.guard, services.stats)
        self.spec_hash = spec_hash
        self.donors = donors  # live peers of our stage that can be called
        self.stall_s = STALL_S if stall_s is None else stall_s  # the module's when not given
        self.min_bytes_per_s = MIN_BYTES_PER_S if min_bytes_per_s is None else min_bytes_per_s
        self.progress = progress
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self._snapshots: dict[str, _Snapshot] = {}  # digest -> snapshot, oldest first
        self._making = asyncio.Lock()

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        await transport.serve(protocols.STATE, self.handle,
                              ServeLimits(max_request_bytes=64 << 10, max_concurrent=4, max_per_peer=1,
                                          handler_timeout_s=2 * self.stall_s),
                              authorize=authorize)

    # -- donor side ---------------------------------------------------------------
    async def handle(self, remote: str, request: bytes) -> bytes:
        """Chunk ``chunk`` of snapshot ``snapshot`` (a new snapshot when null)."""
        try:
            header, _ = decode_frame(request, FrameLimits(max_payload_bytes=0))
            if header.get("kind") != "state" or header.get("spec") != self.spec_hash:
                raise ProtocolError("not a state request of this run")
            snapshot = await self._snapshot_for(header.get("snapshot"), remote)
            if snapshot is None:
                return encode_frame({"ok": False, "error": "busy or expired"})
            chunks = chunk_indices(snapshot["tensors"])
            index = header.get("chunk", 0)
            if type(index) is not int or not 0 <= index < len(chunks):
                raise ProtocolError("bad chunk index")
            meta = {"ok": True, "snapshot": snapshot["digest"], "chunk": index, "num_chunks": len(chunks),
                    "inner_step": snapshot["inner_step"], "outer_round": snapshot["outer_round"],
                    "last_round_step": snapshot["last_round_step"], "num_tensors": len(snapshot["tensors"])}
            return await self.compute(encode_frame, meta, [snapshot["tensors"][i] for i in chunks[index]])
        except ProtocolError as exc:
            self.guard.fault(remote, f"bad state request ({exc})")
            return encode_frame({"ok": False, "error": "protocol"})

    def rule_for(self, num_bytes: int) -> StallRule:
        """When a download of ``num_bytes`` gives its donor up: the stall rule, and cut at
        that size at the floor rate plus ``stall_s`` (a trickle cannot hold a joiner)."""
        return StallRule(self.stall_s, self.min_bytes_per_s, self.stall_s + num_bytes / self.min_bytes_per_s)

    async def _snapshot_for(self, snap_id: object, remote: str) -> dict | None:
        """The snapshot ``snap_id`` (None: the one a new download starts from). A new
        download shares the newest snapshot when it is of our current outer round and
        younger than SHARE_S; otherwise a new one is made, the one served least recently
        dropped first when MAX_SNAPSHOTS are held. So callers, however many, get at most
        one snapshot made a round (and a SHARE_S), are never refused for a full cache, and
        never get one a round stale. Each chunk served keeps its snapshot SNAPSHOT_TTL_S
        more, but none past its cap: a download of it that keeps the floor rate, begun
        within SHARE_S of its making, ends before it; one that stops frees it."""
        if snap_id is not None:
            now = self._expire()
            return self._served(snap_id, now) if isinstance(snap_id, str) else None
        async with self._making:  # callers arriving together share the one made for the first
            now = self._expire()
            newest = max(self._snapshots.values(), key=lambda e: e.made_at, default=None)
            if newest and newest.outer_round == self.worker.outer_round and now - newest.made_at < SHARE_S:
                return self._served(newest.state["digest"], now)
            while len(self._snapshots) >= MAX_SNAPSHOTS:
                del self._snapshots[next(iter(self._snapshots))]
            outer_round = self.worker.outer_round
            snapshot = await self.compute(self.worker.snapshot)
            snapshot = await self.compute(encoded_snapshot, snapshot, len(self.worker.params),
                                          self.worker.slow is not None)
            num_bytes = sum(t.numel() * t.element_size() for t in snapshot["tensors"])
            until = now + max(SNAPSHOT_TTL_S, self.rule_for(num_bytes).max_s + SHARE_S)
            self._snapshots.pop(snapshot["digest"], None)  # the same state again: newest now
            self._snapshots[snapshot["digest"]] = _Snapshot(now, outer_round, snapshot, until, now)
        self.stats.served_digests.append(snapshot["digest"])
        log.info("serving state (step %d, digest %s) to %s", snapshot["inner_step"], snapshot["digest"],
                 short_id(remote))
        return snapshot

    def _served(self, digest: str, now: float) -> dict | None:
        """Snapshot ``digest``, renewed as served now (and so dropped last)."""
        entry = self._snapshots.pop(digest, None)
        if entry is None:
            return None
        entry.served_at = now
        self._snapshots[digest] = entry
        return entry.state

    def _expire(self) -> float:
        now = self.clock()
        self._snapshots = {k: v for k, v in self._snapshots.items()
                           if now - v.served_at < SNAPSHOT_TTL_S and now < v.until}
        return now

    # -- joiner side --------------------------------------------------------------
    async def download(self) -> bool:
        """A state from a live peer of our stage that claims to be ahead of us, picked at
        random (``prefer`` first), adopted only once the stage's other replicas vouch for
        it (state/check.py); the next is tried after a refusal, up to MAX_DONORS.
        Whether a state was adopted (when not, the worker's state is untouched)."""
        started = self.clock()
        try:
            for donor in (await self._donors())[:MAX_DONORS]:
                try:
                    state = await self._fetch(donor)
                    async with asyncio.timeout(CHECK_TIMEOUT_S):
                        verdict = await self._check(donor, state)
                except ImpossibleState as exc:  # no honest peer has such a state: a poisoner
                    self.stats.states_refused += 1
                    self.guard.poisoned(donor, str(exc), what="state")
                    continue
                except ProtocolError as exc:  # a state that does not decode, or not to its digest
                    self.guard.fault(donor, f"bad state from the donor ({exc})")
                    self.guard.failed(donor, reason=None)  # counted once, as the fault
                    continue
                except (PeerError, TimeoutError, ValueError) as exc:
                    log.warning("state download from %s failed (%s); trying another donor", short_id(donor),
                                exc)
                    continue
                if not self._adoptable(donor, verdict):
                    continue
                inner_step, outer_round = verdict.inner_step, verdict.outer_round
                round_steps = min(state.inner_step - state.last_round_step,
                                  self.worker.spec.method.inner_steps)
                await self.compute(self.worker.load_snapshot, inner_step, outer_round, state.tensors,
                                   max(0, inner_step - round_steps))
                self.stats.downloaded_from, self.stats.downloaded_digest = donor, state.digest
                self.witnesses.catching_up = False
                log.info("downloaded state from %s: step %d, round %d, digest %s; %s", short_id(donor),
                         inner_step, outer_round, state.digest, verdict.why)
                return True
            return False
        finally:
            self.stats.state_download_s += self.clock() - started

    def _adoptable(self, donor: str, verdict: Verdict) -> bool:
        """Whether to adopt the state ``verdict`` is on. A refused donor is kept off as a
        poisoner only when an honest majority of the stage disowns its state (the
        verdict's ``poisoner``): a lone dissenter, a tie or silent witnesses ban nobody."""
        self.stats.state_check = verdict.why
        if verdict.accepted:
            return True
        self.stats.states_refused += verdict.checked
        if verdict.poisoner:
            self.guard.poisoned(donor, f"the stage's other replicas disown it: {verdict.why}", what="state")
        else:
            log.warning("not adopting the state from %s: %s; trying another donor", short_id(donor),
                        verdict.why)
        return False

    async def _donors(self) -> list[str]:
        """Live peers of our stage that claim to be ahead of us, among those that exist
        (peers we have reached before, and peers that answer a status request now), in
        random order: what a peer claims never puts it first (a liar claiming the most
        steps would be every joiner's first donor), and a forged record, which has nobody
        behind it, takes no donor slot."""
        own_step = self.worker.inner_step
        ahead = [p for p, r in self.donors().items()
                 if r.inner_step > own_step and not self.guard.is_poisoned(p)]
        donors = await self._existing(ahead)
        self.rng.shuffle(donors)
        if self.prefer is not None:
            if self.prefer in donors:
                donors.remove(self.prefer)
                donors.insert(0, self.prefer)
            else:
                self.guard.note(self.prefer, f"--state-from {short_id(self.prefer)}: not a live peer of our "
                                             "stage ahead of us; choosing donors at random")
        return donors

    async def _existing(self, peers: list[str]) -> list[str]:
        unknown = [p for p in peers
                   if not self.guard.is_verified(p) and not self.guard.is_banned(p)][:MAX_PROBES]
        await asyncio.gather(*(self._probe(p) for p in unknown))
        return [p for p in peers if self.guard.is_verified(p)]

    async def _probe(self, peer: str) -> None:
        if await answers_status(self.transport, peer, PROBE_TIMEOUT_S):
            self.guard.succeeded(peer)
        else:
            self.guard.failed(peer)

    async def _check(self, donor: str, state: Downloaded) -> Verdict:
        """What the other live peers of our stage say of ``state`` (docs/ALGORITHM.md 8)."""
        if self.worker.slow is None:
            return Verdict(True, "not checked: local-only replicas share no state to compare with",
                           inner_step=state.inner_step, outer_round=state.outer_round)
        started = self.clock()
        others = [p for p in self.donors() if p != donor and not self.guard.is_poisoned(p)]
        others = await self._existing(self.rng.sample(others, len(others)))
        asked = others[:MAX_WITNESSES]
        seed = secrets.randbelow(MAX_SKETCH_SEED)  # drawn now: the donor could not aim at it
        candidate, said = await asyncio.gather(self.compute(state.sketch, seed),
                                               self.witnesses.gather(asked, seed))
        self.stats.state_check_s += self.clock() - started
        verdict = check_state(candidate, said, inner_steps=self.worker.spec.method.inner_steps,
                              asked=len(asked))
        if not asked:
            log.warning("the state from %s is not checked: it is the only live peer of stage %d",
                        short_id(donor), self.worker.stage.stage_index)
        return verdict

    async def _fetch(self, donor: str) -> Downloaded:
        """The donor's state, its chunks asked one after the other, each within what the
        stall rule leaves (``rule_for``). A chunk whose stream broke is asked again, up to
        CHUNK_RETRIES times, within that time too. Nothing is resumed from another donor:
        replicas' states differ (their own theta and moments), so another donor never has
        this snapshot, and nothing is verified before its whole digest."""
        limits = FrameLimits(max_payload_bytes=CHUNK_BYTES * 4)
        snap_id, chunk, num_chunks, meta = None, 0, 1, {}
        # decoded as it arrives, the wire tensors hashed and dropped: the state in fp32 and one
        # chunk held, and no more than an honest donor's coded state received
        decoder = StateDecoder([p.shape for p in self.worker.params], self.worker.slow is not None)
        digest = TensorDigest()
        expected_bytes = wire_bytes_cap([p.shape for p in self.worker.params], self.worker.slow is not None)
        received = 0
        loop = asyncio.get_running_loop()
        rule, started = self.rule_for(expected_bytes), loop.time()
        flow = Flow(started)
        flow.join(rule, +1, started)
        bar = tqdm(desc=f"state from {short_id(donor)}", unit="chunk", disable=not self.progress)
        try:
            while chunk < num_chunks:
                request = encode_frame({"kind": "state", "spec": self.spec_hash, "snapshot": snap_id,
                                        "chunk": chunk})
                raw = await self._chunk(donor, request, limits, rule, flow, started)
                meta, part = await self.compute(decode_frame, raw, limits)
                if not meta.get("ok"):
                    raise PeerRefused(str(meta.get("error"))[:200])
                snap_id, num_chunks = check_state_chunk(meta, chunk, snap_id)
                nbytes = sum(t.numel() * t.element_size() for t in part)
                flow.settle(loop.time())
                flow.took(nbytes, loop.time())
                received += nbytes
                if received > expected_bytes:
                    raise ProtocolError(f"the donor sent more than this stage's state ({received} bytes)")
                await self.compute(_take, decoder, digest, part)
                chunk += 1
                bar.total = num_chunks
                bar.update(1)
        finally:
            bar.close()
        if digest.hexdigest() != snap_id:
            raise ProtocolError(f"state digest {digest.hexdigest()} does not match the donor's {snap_id}")
        tensors = decoder.finish()
        inner_step, outer_round, last_round_step = check_state_counters(meta)
        if inner_step <= self.worker.inner_step:
            raise PeerError(f"its state (step {inner_step}) is not ahead of ours "
                            f"(step {self.worker.inner_step})")
        problem = self.worker.snapshot_problem(tensors)
        if problem:
            raise ImpossibleState(problem)
        return Downloaded(tensors, inner_step, outer_round, min(last_round_step, inner_step), snap_id,
                          len(self.worker.params))

    async def _chunk(self, donor: str, request: bytes, limits: FrameLimits, rule: StallRule, flow: Flow,
                     started: float) -> bytes:
        """One chunk's answer, asked again after a broken stream; ``Stalled`` once the
        stall rule or the download's cap leaves no time."""
        loop = asyncio.get_running_loop()
        max_bytes = limits.max_payload_bytes + (1 << 16)
        for attempt in range(CHUNK_RETRIES + 1):
            now = loop.time()
            left_s = min(flow.left_s(rule, now, started), started + rule.max_s - now)
            if left_s <= 0:
                break
            try:
                async with asyncio.timeout(left_s):
                    return await self.transport.request(donor, protocols.STATE, request, timeout_s=left_s,
                                                        max_response_bytes=max_bytes)
            except (TimeoutError, PeerTimeout):
                continue  # the time it left is up (looked at above), or the transport's own
            except PeerError as exc:
                if isinstance(exc, (PeerRefused, ProtocolError)) or attempt == CHUNK_RETRIES:
                    raise
                log.info("state chunk from %s failed (%s); asking again", short_id(donor), exc)
                await asyncio.sleep(min(RETRY_S, left_s))
        elapsed_s = loop.time() - started
        raise Stalled(f"no chunk for {loop.time() - max(flow.moved_at, started):.0f} s, or under "
                      f"{rule.min_bytes_per_s * 8 / 1e6:g} Mbit/s, after {elapsed_s:.0f} s "
                      f"(at most {rule.max_s:.0f} s)")


def _take(decoder: StateDecoder, digest: TensorDigest, tensors: list[torch.Tensor]) -> None:
    """One chunk's wire tensors into the digest and the decoder (on the compute thread)."""
    for t in tensors:
        digest.update(t)
    decoder.feed(tensors)


class ImpossibleState(ProtocolError):
    """A downloaded state no honest replica could hold (StageWorker.snapshot_problem)."""


@dataclass
class _Snapshot:
    made_at: float
    outer_round: int  # ours when it was made
    state: dict  # StageWorker.snapshot
    until: float  # dropped then, however busy: its size at the floor rate after SHARE_S
    served_at: float  # its latest chunk


@dataclass(frozen=True)
class Downloaded:
    """A donor's state as decoded: theta, phi, momentum (one tensor a parameter each), the
    inner optimizer's moments, counters; ``digest``: of the coded tensors it came as."""
    tensors: list[torch.Tensor]
    inner_step: int
    outer_round: int
    last_round_step: int
    digest: str
    num_params: int

    def sketch(self, seed: int) -> StateSketch:
        n = self.num_params
        theta, phi, momentum = self.tensors[:n], self.tensors[n:2 * n], self.tensors[2 * n:3 * n]
        return sketch_state(theta, phi, momentum, inner_step=self.inner_step, outer_round=self.outer_round,
                            round_steps=self.inner_step - self.last_round_step, seed=seed)


def chunk_indices(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Group consecutive tensors into chunks of about CHUNK_BYTES."""
    chunks, current, size = [], [], 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > CHUNK_BYTES:
            chunks.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        chunks.append(current)
    return chunks

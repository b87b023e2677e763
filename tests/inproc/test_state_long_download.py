"""A state download as long as its link needs (docs/ARCHITECTURE.md failure table, "a slow
or stalling donor"; docs/PROTOCOL.md 4.4): a joiner keeps a donor while its chunks keep
coming, however long the whole takes; gives it up by the stall rule (no chunk for
STALL_S, or more than STALL_S behind MIN_BYTES_PER_S) and takes the next; a donor keeps
a snapshot while it is served, up to a cap from its size at that floor, and drops an
idle one; callers still hold at most MAX_SNAPSHOTS, and none past its cap.

The debug stage's state is 0.39 MB: chunks of 16 KiB and a floor of 500 bytes/s stand in
for a multi-GB stage's 4 MiB chunks at 1 Mbit/s (the same rules, at scale). Delays are
the virtual clock's."""

from __future__ import annotations

import asyncio
import random

import pytest
import vclock
from state_peers import SPEC, Stage, joiner, replica

from swarm_node.errors import StreamClosed
from swarm_node.net import protocols
from swarm_node.state import sync as state_sync_module
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame

CHUNK_BYTES = 16 << 10
STALL_S, FLOOR = 60.0, 500.0  # bytes/s
OLD_TOTAL_S = 120.0  # the fixed total a download had


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(state_sync_module, "CHUNK_BYTES", CHUNK_BYTES)
    monkeypatch.setattr(state_sync_module, "STALL_S", STALL_S, raising=False)
    monkeypatch.setattr(state_sync_module, "MIN_BYTES_PER_S", FLOOR, raising=False)


class SlowStage(Stage):
    """State chunks take ``delay_s[peer]`` each (virtual); a peer in ``stall_after`` answers
    that many chunks and then never again (its stream stays open, silent)."""

    def __init__(self, peers, delay_s: dict[str, float], stall_after: dict[str, int] | None = None):
        super().__init__(peers)
        self.delay_s, self.stall_after = delay_s, stall_after or {}
        self.chunks: dict[str, list[float]] = {p: [] for p in peers}  # when each chunk was answered

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
        if protocol != protocols.STATE:
            return await super().request(peer, protocol, payload, timeout_s=timeout_s,
                                         max_response_bytes=max_response_bytes)
        if len(self.chunks[peer]) >= self.stall_after.get(peer, 1 << 30):
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s.get(peer, 0.0))
        answer = await super().request(peer, protocol, payload, timeout_s=timeout_s,
                                       max_response_bytes=max_response_bytes)
        self.chunks[peer].append(asyncio.get_running_loop().time())
        return answer


def three_peers() -> dict:
    base = StageWorker(SPEC, 1, 16)
    return {name: replica(base, i + 1) for i, name in enumerate(("QmA", "QmB", "QmC"))}


def download(stage: SlowStage, peers: dict, prefer: str):
    node = joiner(stage, peers, prefer=prefer, rng=random.Random(0))

    async def timed():
        ok = await node.sync.download()
        return ok, asyncio.get_running_loop().time()

    ok, took_s = vclock.run(timed())
    return node, ok, took_s


def test_a_download_longer_than_two_minutes_succeeds_while_chunks_keep_coming():
    """25 chunks of 16 KiB, 20 s each (800 bytes/s, above the floor): 8 minutes in all."""
    peers = three_peers()
    stage = SlowStage(peers, {"QmA": 20.0})
    node, ok, took_s = download(stage, peers, "QmA")
    assert ok and node.stats.downloaded_from == "QmA", node.stats.state_check
    assert len(stage.chunks["QmA"]) > 12 and took_s > 2 * OLD_TOTAL_S


def test_a_donor_that_stalls_mid_download_is_given_up_after_stall_s_and_the_next_used():
    """QmA answers 8 chunks (160 s) and then nothing: the joiner waits STALL_S after its
    last chunk, not less, then downloads from another donor, slowly too, and adopts it."""
    peers = three_peers()
    stage = SlowStage(peers, {"QmA": 20.0, "QmB": 20.0, "QmC": 20.0}, stall_after={"QmA": 8})
    node, ok, took_s = download(stage, peers, "QmA")
    assert ok and node.stats.downloaded_from in ("QmB", "QmC")
    second = stage.chunks[node.stats.downloaded_from]
    gave_up_at = second[0] - 20.0  # its first chunk was asked then
    assert len(stage.chunks["QmA"]) == 8
    assert gave_up_at == pytest.approx(stage.chunks["QmA"][-1] + STALL_S)
    assert second[-1] - second[0] > OLD_TOTAL_S


def test_a_trickling_donor_is_given_up_by_the_floor_rate():
    """QmA sends a chunk every 50 s (never STALL_S quiet), at most 330 bytes/s, under the
    500 bytes/s floor: given up once more than STALL_S behind it (30 KB), within a few
    chunks, long before the cap (its size at the floor: 13 minutes), and the next donor
    adopted."""
    peers = three_peers()
    stage = SlowStage(peers, {"QmA": 50.0, "QmB": 20.0, "QmC": 20.0})
    node, ok, _ = download(stage, peers, "QmA")
    assert ok and node.stats.downloaded_from in ("QmB", "QmC")
    given_up_s = stage.chunks[node.stats.downloaded_from][0] - 20.0
    assert stage.chunks["QmA"] and given_up_s - stage.chunks["QmA"][-1] < STALL_S  # not for quiet
    assert given_up_s < 4 * STALL_S


class BrokenOnce(SlowStage):
    """QmA's stream for chunk ``at`` breaks once (a reset), then answers as before."""

    def __init__(self, peers, delay_s, at: int):
        super().__init__(peers, delay_s)
        self.at, self.broken = at, 0

    async def request(self, peer, protocol, payload, **kwargs):
        if (protocol == protocols.STATE and peer == "QmA" and len(self.chunks[peer]) == self.at
                and not self.broken):
            self.broken += 1
            raise StreamClosed("stream reset")
        return await super().request(peer, protocol, payload, **kwargs)


def test_a_broken_chunk_stream_is_asked_again_of_the_same_donor():
    """A reset mid-download costs a retry, not the chunks already received."""
    peers = three_peers()
    stage = BrokenOnce(peers, {}, at=5)
    node, ok, _ = download(stage, peers, "QmA")
    assert ok and stage.broken == 1 and node.stats.downloaded_from == "QmA"


# -- the donor's side -----------------------------------------------------------------
def state_request(snapshot=None, chunk: int = 0) -> bytes:
    return encode_frame({"kind": "state", "spec": SPEC.spec_hash(), "snapshot": snapshot, "chunk": chunk})


def answer_of(raw: bytes) -> dict:
    return decode_frame(raw, FrameLimits(max_payload_bytes=64 << 20))[0]


def donor(now: list[float]):
    parts = replica(StageWorker(SPEC, 1, 16), 1)
    return parts, parts.state_sync(clock=lambda: now[0])


def cap_s(sync) -> float:
    """A snapshot's longest life: its size at the floor, STALL_S and SHARE_S on top."""
    entry = next(iter(sync._snapshots.values()))
    size = sum(t.numel() * t.element_size() for t in entry.state["tensors"])
    return STALL_S + size / FLOOR + state_sync_module.SHARE_S


def test_a_served_snapshot_stays_until_its_cap_and_an_idle_one_expires():
    """Served every 100 s, a snapshot outlives SNAPSHOT_TTL_S many times over, but not its
    cap (a caller cannot keep it forever); one left idle for SNAPSHOT_TTL_S is gone."""
    now = [0.0]
    _, sync = donor(now)

    async def scenario():
        first = answer_of(await sync.handle("QmA", state_request()))
        snap, num_chunks, cap = first["snapshot"], first["num_chunks"], cap_s(sync)
        alive = []
        while now[0] + 100.0 < cap:
            now[0] += 100.0
            alive.append(answer_of(await sync.handle("QmA", state_request(snap, 1 % num_chunks)))["ok"])
        now[0] = cap
        at_cap = answer_of(await sync.handle("QmA", state_request(snap, 0)))["ok"]
        idle = answer_of(await sync.handle("QmB", state_request()))["snapshot"]
        now[0] += state_sync_module.SNAPSHOT_TTL_S
        after_idle = answer_of(await sync.handle("QmB", state_request(idle, 0)))["ok"]
        return alive, cap, at_cap, after_idle

    alive, cap, at_cap, after_idle = vclock.run(scenario())
    assert cap > 5 * state_sync_module.SNAPSHOT_TTL_S and len(alive) >= 5 and all(alive), alive
    assert not at_cap and not after_idle


def test_a_moving_download_keeps_its_snapshot_while_new_rounds_fill_the_cache():
    """A snapshot served every 10 s outlives MAX_SNAPSHOTS newer ones that nobody serves:
    the least recently served is dropped for a new one, not the oldest made. Callers
    keeping every snapshot busy still make the donor hold at most MAX_SNAPSHOTS."""
    now = [0.0]
    parts, sync = donor(now)

    async def new_round_snapshot(caller: str) -> str:
        parts.worker.outer_round += 1
        parts.worker.params[0].data += 1e-3  # another state, another digest
        return answer_of(await sync.handle(caller, state_request()))["snapshot"]

    async def scenario():
        moving = await new_round_snapshot("QmJoiner")
        held, served = [], []
        for i in range(3 * state_sync_module.MAX_SNAPSHOTS):
            now[0] += 10.0
            served.append(answer_of(await sync.handle("QmJoiner", state_request(moving, 0)))["ok"])
            hostile = await new_round_snapshot(f"QmH{i}")
            for snap in list(sync._snapshots):  # the hostile callers keep theirs busy too
                if snap != moving:
                    await sync.handle(f"QmH{i}", state_request(snap, 0))
            held.append(len(sync._snapshots))
            assert hostile in sync._snapshots
        return served, held

    served, held = vclock.run(scenario())
    assert all(served), served
    assert max(held) == state_sync_module.MAX_SNAPSHOTS


def test_the_documented_numbers_are_the_codes(monkeypatch):
    """docs/PROTOCOL.md 4.4: 60 s without a chunk, 1 Mbit/s; the node's settings default to them."""
    from swarm_node.node_config import NodeConfig
    monkeypatch.undo()
    assert (state_sync_module.STALL_S, state_sync_module.MIN_BYTES_PER_S) == (60.0, 1e6 / 8)
    fields = NodeConfig.__dataclass_fields__
    assert (fields["state_stall_s"].default, fields["state_min_mbit_s"].default) == (60.0, 1.0)

"""The state check against colluders and floods (docs/ALGORITHM.md 8, "Who decides"):
honest witnesses kept busy or silent buy no state and get nobody banned; a witness
answers each caller a few sketches, then one per interval, and "busy" beyond two at
once; one colluding witness neither widens the bounds nor sets the adopted counters;
one liar cannot frame the only other peer of a stage; callers share a donor's
snapshots instead of filling its cache. Busy is injected through the stage fake."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
import torch
import vclock
from parts import StageParts, record
from state_peers import SPEC, STEP, Stage, joiner, replica

from swarm_node.errors import PeerRefused
from swarm_node.net import protocols
from swarm_node.net.exists import answers_status
from swarm_node.state import sync as state_sync_module
from swarm_node.state.sketch import SKETCH_BUCKETS
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.state_codec import encoded_snapshot

HONEST = ("QmH1", "QmH2", "QmH3")
SKETCH_BURST, SKETCH_INTERVAL_S = 4, 30.0  # docs/PROTOCOL.md 4.4.1: a caller's sketches
SHARE_S = 30.0  # docs/PROTOCOL.md 4.4: a snapshot is shared this long within its round


def stage_of(base: StageWorker, honest: int, **liars: float) -> dict[str, StageParts]:
    """``honest`` replicas QmH1.., and liars by id with the scale of their states."""
    peers = {f"QmH{i + 1}": replica(base, i + 1) for i in range(honest)}
    peers.update({name: replica(base, 70 + i, scale=scale) for i, (name, scale) in enumerate(liars.items())})
    return peers


def progress_norm(worker: StageWorker) -> float:
    return float(sum((p.detach() - phi).pow(2).sum() for p, phi in zip(worker.params,
                                                                       worker.slow.phi)).sqrt())


# -- H5: busy witnesses ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["busy", "silent"])
def test_honest_witnesses_kept_busy_buy_no_state(how):
    """Two colluders (the donor and one witness) against three honest peers kept busy:
    only the colluding witness answers. Its vote is no majority of the panel, so the
    poisoned state is not adopted (a vote among whoever answered took it)."""
    base = StageWorker(SPEC, 1, 16)
    peers = stage_of(base, 3, QmL=1.5, QmL2=1.5)
    stage = Stage(peers, **{how: HONEST})
    node = joiner(stage, peers, prefer="QmL", rng=random.Random(0))
    assert not vclock.run(node.sync.download())
    assert node.stats.downloaded_from is None and node.worker.inner_step == 0
    assert not any(node.guard.is_poisoned(p) for p in HONEST)
    assert "asked silent" in node.stats.state_check


def test_a_donor_is_not_banned_on_one_witness_while_the_others_are_busy():
    """The same trick turned on an honest donor: its witnesses busy but one colluder,
    which disowns it. One dissenter of four asked bans nobody."""
    base = StageWorker(SPEC, 1, 16)
    peers = stage_of(base, 4, QmL2=1.5)
    stage = Stage(peers, busy=("QmH2", "QmH3", "QmH4"))
    node = joiner(stage, peers, prefer="QmH1", rng=random.Random(0))
    vclock.run(node.sync.download())
    assert not any(node.guard.is_poisoned(f"QmH{i}") for i in range(1, 5))
    assert node.stats.downloaded_from in (None, "QmH2", "QmH3", "QmH4")


def test_a_busy_status_answer_is_an_existing_peer():
    """A witness kept busy answers its status probe "busy": it exists, so it stays on the
    panel (silent) instead of being dropped from it (which shrank the panel to the
    colluders)."""
    class Busy:
        async def request(self, *args, **kwargs):
            raise PeerRefused("QmH1 is busy")

    assert vclock.run(answers_status(Busy(), "QmH1", 5.0))


def sketch_request(seed: int = 7) -> bytes:
    return encode_frame({"kind": "sketch", "spec": SPEC.spec_hash(), "seed": seed, "buckets": SKETCH_BUCKETS})


def test_a_witness_sketches_a_few_for_each_caller_then_one_per_interval():
    witnesses = replica(StageWorker(SPEC, 1, 16), 1).witnesses()

    async def scenario():
        answers = [decode_frame(await witnesses.handle("QmFlood", sketch_request()))[0]["ok"]
                   for _ in range(SKETCH_BURST + 1)]
        other = decode_frame(await witnesses.handle("QmJoiner", sketch_request()))[0]["ok"]
        await asyncio.sleep(SKETCH_INTERVAL_S)
        again = decode_frame(await witnesses.handle("QmFlood", sketch_request()))[0]["ok"]
        return answers, other, again

    answers, other, again = vclock.run(scenario())
    assert answers == [True] * SKETCH_BURST + [False]
    assert other and again


def test_a_witness_making_two_sketches_answers_busy_at_once():
    """Held in its compute (a barrier): two sketches under way, the third caller is told
    "busy" (an empty frame) without waiting, and the two finish."""
    parts = replica(StageWorker(SPEC, 1, 16), 1)
    release = asyncio.Event()

    async def held(fn, *args):
        await release.wait()
        return fn(*args)

    parts.compute = held
    witnesses = parts.witnesses()

    async def scenario():
        first = [asyncio.create_task(witnesses.handle(f"QmJ{i}", sketch_request())) for i in range(2)]
        await asyncio.sleep(0)
        third = await asyncio.wait_for(witnesses.handle("QmJ3", sketch_request()), 1.0)
        release.set()
        return third, [decode_frame(t)[0]["ok"] for t in await asyncio.gather(*first)]

    third, first = vclock.run(scenario())
    assert third == b"" and first == [True, True]


# -- H6: progress and momentum bounds ---------------------------------------------------
def ran_ahead(parts: StageParts, progress: float, momentum: float = 1.0) -> StageParts:
    for p, phi, m in zip(parts.worker.params, parts.worker.slow.phi, parts.worker.slow.momentum):
        p.data.copy_(phi + progress * (p.detach() - phi))
        m.mul_(momentum)
    return parts


@pytest.mark.parametrize("first_round", [False, True])
def test_one_colluding_witness_does_not_widen_the_progress_bound(first_round):
    """A donor with 50x the progress and 3x the momentum (round 0: no momentum anywhere,
    and phi times 1.5) and one colluding witness claiming 1000x the progress, among four
    honest witnesses: the bounds are trimmed like the spread, so the donor's state is
    refused and an honest one adopted (a plain maximum took the donor's with 5 of 5)."""
    base = StageWorker(SPEC, 1, 16)
    peers = stage_of(base, 4)
    peers["QmL"] = ran_ahead(replica(base, 9, scale=1.5 if first_round else 1.0), 50, 3)
    peers["QmL2"] = ran_ahead(replica(base, 10), 1000)
    if first_round:
        for parts in peers.values():
            for m in parts.worker.slow.momentum:
                m.zero_()
    node = joiner(Stage(peers), peers, prefer="QmL", rng=random.Random(0))
    assert vclock.run(node.sync.download())
    assert node.stats.downloaded_from.startswith("QmH")
    assert progress_norm(node.worker) < 2 * progress_norm(peers["QmH1"].worker)


# -- M5: one honest peer and one liar -----------------------------------------------------
def first_asked(peers, seed: int) -> str:
    stage = Stage(peers)
    vclock.run(joiner(stage, peers, rng=random.Random(seed)).sync.download())
    return next(p for p, proto in stage.asked if proto == protocols.STATE)


def test_a_liar_cannot_frame_the_only_other_peer_of_its_stage():
    """{honest, liar}: asked first, the honest peer has only the liar as witness. A lone
    dissenter bans nobody, so the honest peer stays the liar's witness and the liar's
    state is refused too: nothing adopted, nobody banned (a ban, then the liar's state
    unchecked as the only live peer, was what happened)."""
    base = StageWorker(SPEC, 1, 16)
    peers = {"QmH": replica(base, 1), "QmL": replica(base, 2, scale=1.5)}
    seeds = [s for s in range(10) if first_asked(peers, s) == "QmH"]
    assert seeds
    for seed in seeds:
        node = joiner(Stage(peers), peers, rng=random.Random(seed))
        assert not vclock.run(node.sync.download())
        assert not node.guard.is_poisoned("QmH") and node.stats.downloaded_from is None


def test_a_peer_far_behind_is_no_evidence_to_ban_a_donor_on():
    """The multi-host case, a joiner later: the first joiner adopted nothing and trains
    from where the stage began (rounds behind), and the liar now answers sketches with a
    state like that joiner's, claiming the stage's round. The two disown the honest peer,
    but a peer far from the donor's round is no evidence for a ban (their agreement on
    next to no spread made the honest peer a poisoner); the liar's own state is refused."""
    base = StageWorker(SPEC, 1, 16)
    peers = {"QmH": replica(base, 1), "QmL": replica(base, 2, scale=1.5), "QmJ1": replica(base, 3)}
    fresh = peers["QmJ1"].worker
    gen = torch.Generator().manual_seed(3)
    for p, phi, m in zip(fresh.params, fresh.slow.phi, fresh.slow.momentum):
        phi.add_(torch.randn(phi.shape, generator=gen) * 0.05)
        p.data.copy_(phi)
        m.zero_()
    fresh.inner.step_count, fresh.outer_round, fresh.last_round_step = 30, 3, 30
    mimic = StageWorker(SPEC, 1, 16)  # the fresh joiner's state, the stage's counters
    mimic.load_snapshot(STEP, 25, fresh.snapshot()["tensors"], STEP)
    for seed in range(4):
        stage = Stage(peers)
        stage.witnesses["QmL"] = StageParts(SPEC, mimic).witnesses()
        node = joiner(stage, peers, prefer="QmH", rng=random.Random(seed))
        node.membership.peers[1]["QmJ1"] = record(1, SPEC, inner_step=30)
        vclock.run(node.sync.download())
        assert not node.guard.is_poisoned("QmH")
        assert node.stats.downloaded_from != "QmL"


# -- M6: adopted counters ------------------------------------------------------------------
def test_one_colluding_witness_does_not_set_the_adopted_step():
    base = StageWorker(SPEC, 1, 16)
    peers = stage_of(base, 3, QmL=1.0, QmL2=1.0)
    for liar in ("QmL", "QmL2"):
        peers[liar].worker.inner.step_count = 10**11
    node = joiner(Stage(peers), peers, prefer="QmL", rng=random.Random(0))
    node.membership.peers[1]["QmL"] = record(1, SPEC, inner_step=10**11)
    assert vclock.run(node.sync.download())
    assert node.stats.downloaded_from == "QmL" and node.worker.inner_step == STEP


# -- M7: the snapshot cache ------------------------------------------------------------------
def state_request(snapshot=None, chunk: int = 0) -> bytes:
    return encode_frame({"kind": "state", "spec": SPEC.spec_hash(), "snapshot": snapshot, "chunk": chunk})


def answer_of(raw: bytes) -> dict:
    return decode_frame(raw, FrameLimits(max_payload_bytes=64 << 20))[0]


def held_bytes(sync) -> int:
    return sum(t.numel() * t.element_size() for s in sync._snapshots.values() for t in s.state["tensors"])


def test_callers_share_a_snapshot_instead_of_filling_the_cache():
    """Four callers starting downloads one second apart get one snapshot between them,
    and a joiner after them gets it too (four such callers refused every joiner for
    two minutes, each holding a copy of five times the stage)."""
    now = [0.0]
    sync = replica(StageWorker(SPEC, 1, 16), 1).state_sync(clock=lambda: now[0])

    async def scenario():
        answers = []
        for caller in ("QmA", "QmB", "QmC", "QmD", "QmJoiner"):
            answers.append(answer_of(await sync.handle(caller, state_request())))
            now[0] += 1.0
        return answers

    answers = vclock.run(scenario())
    assert all(a["ok"] for a in answers) and len({a["snapshot"] for a in answers}) == 1
    coded = encoded_snapshot(sync.worker.snapshot(), len(sync.worker.params), True)
    one = sum(t.numel() * t.element_size() for t in coded["tensors"])
    assert held_bytes(sync) == one


def test_callers_arriving_together_share_the_snapshot_made_for_the_first():
    """Three callers while the first snapshot is still being made (held at a barrier):
    one is made, and all three get it."""
    parts = replica(StageWorker(SPEC, 1, 16), 1)
    release, made = asyncio.Event(), []

    async def held(fn, *args):
        if getattr(fn, "__name__", "") == "snapshot":
            made.append(fn)
            await release.wait()
        return fn(*args)

    parts.compute = held
    sync = parts.state_sync()

    async def scenario():
        calls = [asyncio.create_task(sync.handle(caller, state_request())) for caller in ("QmA", "QmB",
                                                                                          "QmC")]
        for _ in range(5):
            await asyncio.sleep(0)
        release.set()
        return [answer_of(raw) for raw in await asyncio.gather(*calls)]

    answers = vclock.run(scenario())
    assert len(made) == 1 and all(a["ok"] for a in answers) and len({a["snapshot"] for a in answers}) == 1


def test_a_snapshot_a_round_and_at_most_four_held():
    """A new round makes a new snapshot; past four the oldest is dropped (its callers
    start again elsewhere): a caller can neither be refused nor make the donor hold
    more. Within a round, a snapshot is shared for SHARE_S only."""
    now = [0.0]
    parts = replica(StageWorker(SPEC, 1, 16), 1)
    sync = parts.state_sync(clock=lambda: now[0])

    async def scenario():
        ids = []
        for _ in range(state_sync_module.MAX_SNAPSHOTS + 1):
            ids.append(answer_of(await sync.handle("QmA", state_request()))["snapshot"])
            parts.worker.outer_round += 1
            parts.worker.params[0].data += 1e-3  # another state, another digest
        oldest = answer_of(await sync.handle("QmB", state_request(ids[0], 0)))
        now[0] += SHARE_S
        later = answer_of(await sync.handle("QmB", state_request()))["snapshot"]
        return ids, oldest, later

    ids, oldest, later = vclock.run(scenario())
    assert len(set(ids)) == len(ids) and not oldest["ok"] and later not in ids
    assert len(sync._snapshots) == state_sync_module.MAX_SNAPSHOTS


# -- L10: two witnesses -----------------------------------------------------------------------
def test_with_two_witnesses_the_line_says_an_agreement_rests_on_the_others_bounds(caplog):
    """{honest, liar, colluding witness far off}: the colluder widens the bounds of the
    honest witness's vote. Two colluders of three win by the tie rule (the limit the
    table states), but the line must not read as two witnesses vouching."""
    base = StageWorker(SPEC, 1, 16)
    peers = stage_of(base, 1, QmL=1.5)
    peers["QmL2"] = ran_ahead(replica(base, 8, scale=3.0), 1000, 1000)
    node = joiner(Stage(peers), peers, prefer="QmL", rng=random.Random(0))
    with caplog.at_level(logging.INFO, logger="swarm_node"):
        vclock.run(node.sync.download())
    verdicts = [r.getMessage() for r in caplog.records if "peers agree" in r.getMessage()]
    assert verdicts and "2 of 2 peers agree (" not in verdicts[0], verdicts


def test_the_documented_numbers_are_the_codes():
    from swarm_node.state import witnesses
    assert (witnesses.SKETCH_BURST, witnesses.SKETCH_INTERVAL_S) == (SKETCH_BURST, SKETCH_INTERVAL_S)
    assert state_sync_module.SHARE_S == SHARE_S

"""The peer guard: bans of peers that failed a call double up to a cap and end, one
stream reset is forgiven, callers that send garbage are cut off for a while, and every
table stays bounded whatever number of ids an attacker uses. The chooser skips banned
peers and prefers fast, empty ones, and what it measured of a peer fades as the peer
misses its turns."""

import logging
import random
from collections import Counter

from swarm_node.net import guard as guard_module
from swarm_node.net.guard import PeerGuard
from swarm_node.routing.chooser import Candidate, PeerChooser, RoundTrips


def clocked(**kwargs) -> tuple[PeerGuard, list[float]]:
    now = [100.0]
    return PeerGuard(clock=lambda: now[0], **kwargs), now


def test_a_failed_peer_is_banned_for_doubling_times_up_to_the_cap_and_forgiven_after():
    guard, now = clocked(base_ban_s=5.0, max_ban_s=120.0)
    lengths = [guard.failed("QmA") for _ in range(7)]
    assert lengths == [5.0, 10.0, 20.0, 40.0, 80.0, 120.0, 120.0]
    assert guard.is_banned("QmA") and not guard.is_banned("QmB")
    now[0] += 119.0
    guard.succeeded("QmA")  # still banned: a success does not lift a running ban
    assert guard.is_banned("QmA")
    now[0] += 1.0
    assert not guard.is_banned("QmA")
    guard.succeeded("QmA")
    assert guard.failed("QmA") == 5.0  # strikes forgiven


def test_one_stream_reset_is_forgiven_two_in_a_row_are_not_and_a_success_resets():
    guard, _ = clocked()
    assert guard.stream_closed("QmA") is False
    assert guard.stream_closed("QmA") is True
    guard.succeeded("QmA")
    assert guard.stream_closed("QmA") is False


def test_a_caller_is_cut_off_after_repeated_faults_and_let_in_again_later(caplog):
    guard, now = clocked(max_faults=3, caller_ban_s=600.0)
    for i in range(2):
        guard.fault("QmBad", f"garbage {i}")
    assert guard.admit("QmBad") and guard.faults("QmBad") == 2
    guard.fault("QmBad", "garbage 2")
    assert not guard.admit("QmBad") and guard.admit("QmGood") and guard.faults("QmBad") == 0
    assert sum("ignoring peer" in r.getMessage() for r in caplog.records) == 1  # logged once
    now[0] += 600.0
    assert guard.admit("QmBad")


def test_faults_far_apart_are_forgotten():
    """An honest caller on a bad link may look like a staller once in a long while: a
    fault 10 minutes after the last starts the count anew. An offender repeats within
    seconds, and is banned."""
    guard, now = clocked(max_faults=3, caller_ban_s=600.0)
    for _ in range(5):
        guard.fault("QmUnlucky", "stalled")
        now[0] += 601.0
    assert guard.admit("QmUnlucky") and guard.faults("QmUnlucky") == 0
    for _ in range(3):
        guard.fault("QmBad", "stalled")
        now[0] += 1.0
    assert not guard.admit("QmBad")


def test_a_closed_run_admits_only_its_list():
    guard = PeerGuard(admits=lambda peer: peer == "QmMember")
    assert guard.admit("QmMember") and not guard.admit("QmStranger")


def test_every_table_stays_bounded(monkeypatch):
    monkeypatch.setattr(guard_module, "MAX_TRACKED_PEERS", 50)
    guard, _ = clocked(max_faults=1000)
    for i in range(500):
        guard.failed(f"Qm{i}")
        guard.stream_closed(f"Qm{i}")
        guard.fault(f"Qm{i}", "garbage")
    assert len(guard._bans) <= 50 and len(guard._streams_closed) <= 50 and len(guard._faults) <= 50
    assert len(guard._ignored) <= 50


def test_the_chooser_skips_banned_peers_and_prefers_fast_empty_ones():
    guard, _ = clocked()
    chooser = PeerChooser(is_banned=guard.is_banned, rng=random.Random(0))
    candidates = [Candidate("QmFast", 100.0, 0), Candidate("QmSlow", 10.0, 0), Candidate("QmBusy", 100.0, 9),
                  Candidate("QmDead", 1000.0, 0)]
    guard.failed("QmDead")
    picks = Counter(chooser.choose(candidates) for _ in range(2000))
    assert "QmDead" not in picks
    assert picks["QmFast"] > 5 * picks["QmSlow"] and picks["QmFast"] > 5 * picks["QmBusy"]
    assert chooser.choose(candidates, exclude={"QmFast", "QmSlow", "QmBusy"}) is None
    chooser.started("QmFast")
    chooser.started("QmFast")
    chooser.finished("QmFast")
    assert chooser.in_flight == {"QmFast": 1}


def test_the_chooser_sends_a_peer_no_more_at_once_than_it_serves_one_caller():
    """A next-stage peer answers busy beyond 4 of one caller's requests at once (the
    pipeline's FORWARD_PER_CALLER): a 2 x 2 run lost micro-batches when stage 0's window
    sent the single stage-1 peer a fifth."""
    chooser = PeerChooser(rng=random.Random(0))
    candidates = [Candidate("QmFast", 100.0, 0), Candidate("QmSlow", 1.0, 0)]
    for _ in range(4):
        chooser.started("QmFast")
    assert {chooser.choose(candidates, per_peer=4) for _ in range(50)} == {"QmSlow"}
    for _ in range(4):
        chooser.started("QmSlow")
    assert chooser.choose(candidates, per_peer=4) is None
    chooser.finished("QmSlow")
    assert chooser.choose(candidates, per_peer=4) == "QmSlow"


def test_a_measured_rate_fades_towards_the_best_as_the_peer_misses_its_turns():
    trips = RoundTrips()
    trips.note("QmWarming", 4, 2.0)  # 2 samples/s: one slow answer, a warm-up
    for _ in range(6):
        trips.note("QmFast", 4, 0.02)  # 200 samples/s
    fresh = trips.candidate("QmWarming", 0)
    assert fresh.throughput == 2.0 and fresh.confidence > 0.5
    for _ in range(60):  # 30 turns more it was not chosen in: five halvings of its say
        trips.note("QmFast", 4, 0.02)
    stale = trips.candidate("QmWarming", 0)
    assert stale.throughput == 2.0 and stale.confidence < 0.15
    chooser = PeerChooser(rng=random.Random(0))
    picks = Counter(chooser.choose([stale, trips.candidate("QmFast", 0)]) for _ in range(2000))
    assert picks["QmWarming"] > 0.3 * 2000  # probed again: close to the best rate's weight
    trips.note("QmWarming", 4, 0.02)  # as fast as the other now: the one answer outweighs the old
    assert trips.candidate("QmWarming", 0).throughput > 150
    trips.keep_only(["QmFast"])
    assert trips.candidate("QmWarming", 0) == Candidate("QmWarming", 0.0, 0)  # gone: unmeasured again


def test_notes_about_a_peer_are_logged_at_most_once_a_minute(caplog):
    """30 forged peers failing every time their ban ran out wrote about 150 lines per node
    in 4 minutes of a multi-host run: one line a minute per offender is enough."""
    now = [0.0]
    guard = PeerGuard(clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="swarm_node.net.guard"):
        for second in range(0, 130, 5):
            now[0] = float(second)
            guard.note("QmForged", f"stage-1 peer Forged failed at {second}")
            guard.note("QmOther", f"stage-1 peer Other failed at {second}")
    lines = [r.getMessage() for r in caplog.records]
    assert [ln for ln in lines if "Forged" in ln] == [f"stage-1 peer Forged failed at {t}" for t in (0, 60,
                                                                                                     120)]
    assert len([ln for ln in lines if "Other" in ln]) == 3


def test_refusals_are_counted_by_reason_from_a_fixed_vocabulary():
    import pytest

    from swarm_node.net.refusals import REASONS

    guard, _ = clocked(max_faults=2)
    guard.fault("QmBad", "garbage")  # malformed, by default
    guard.fault("QmBad", "garbage again")  # and the ban it starts
    guard.fault("QmData", "a chunk the manifest does not know", reason="bad-data")
    guard.fault("QmCounted", "the transport counted it", reason=None)
    guard.failed("QmGone")
    guard.failed("QmBad", reason=None)  # counted as its fault already
    guard.failed("QmFar", reason="rounds-apart")
    guard.poisoned("QmPoison", "x1000")
    guard.poisoned("QmLiar", "disowned", what="state")
    guard.ignore("QmForeign", "another run's record", reason="bad-record")
    guard.ignore("QmLogged", "only logged")
    assert guard.refusals.as_dict() == {**dict.fromkeys(REASONS, 0), "malformed": 2, "banned": 1,
                                        "bad-data": 1, "failed": 1, "rounds-apart": 1, "poisoned": 1,
                                        "bad-state": 1, "bad-record": 1}
    assert guard.is_banned("QmPoison") and guard.is_poisoned("QmLiar") and not guard.admit("QmBad")
    with pytest.raises(ValueError, match="unknown refusal reason"):
        guard.fault("QmBad", "garbage", reason="per-peer-QmBad")  # the vocabulary stays bounded

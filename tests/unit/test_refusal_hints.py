"""The ``seekers`` field of a refused proposal (wire/messages.py) and the table behind it
(gossip/seekers.py): valid hints round-trip, anything else is a ProtocolError and never
another exception, frames without the field (older nodes) read as no hints, and the
registry's compact records read back as the records they were."""

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_node.errors import ProtocolError
from swarm_node.gossip.seekers import MAX_TRACKED, SEEKER_FRESH_S, Seekers
from swarm_node.wire.frames import encode_frame
from swarm_node.wire.messages import (
    MAX_SEEKER_HINTS,
    answer_is_yes,
    refusal,
    refusal_hints,
    refusal_ready_in_s,
)
from swarm_node.wire.records import PeerRecord

peer_ids = st.text(string.ascii_letters + string.digits, min_size=1, max_size=64)
anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=80)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@given(st.text(max_size=40), st.lists(peer_ids, max_size=MAX_SEEKER_HINTS))
@settings(max_examples=300, deadline=None)
def test_hints_round_trip_and_the_answer_stays_a_refusal(why, seekers):
    raw = refusal(why, seekers)
    assert refusal_hints(raw) == seekers
    assert answer_is_yes(raw) == (False, why[:200])


@given(anything)
@settings(max_examples=1000, deadline=None)
def test_any_seekers_field_decodes_or_raises_protocol_error(value):
    raw = encode_frame({"ok": False, "error": "busy", "seekers": value})
    try:
        hints = refusal_hints(raw)
    except ProtocolError:
        return
    assert isinstance(hints, list) and len(hints) <= MAX_SEEKER_HINTS
    assert all(isinstance(h, str) and h.isascii() and h.isalnum() and 0 < len(h) <= 64 for h in hints)


@given(st.binary(max_size=256))
@settings(max_examples=1000, deadline=None)
def test_random_bytes_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        refusal_hints(data)


def test_an_older_nodes_refusal_has_no_hints():
    assert refusal_hints(encode_frame({"ok": False, "error": "not-ready"})) == []
    # no hints: the frame older nodes sent
    assert refusal("busy") == encode_frame({"ok": False, "error": "busy"})


def test_too_many_hints_are_cut_when_sent_and_refused_when_read():
    assert len(refusal_hints(refusal("busy", [f"Qm{i}" for i in range(10)]))) == MAX_SEEKER_HINTS
    with pytest.raises(ProtocolError):
        refusal_hints(encode_frame({"ok": False, "seekers": [f"Qm{i}" for i in range(MAX_SEEKER_HINTS + 1)]}))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_seekers_are_fresh_for_a_window_and_named_freshest_first():
    clock = Clock()
    seekers = Seekers(clock)
    for i, peer in enumerate(["a", "b", "c", "d"]):
        clock.now = i * 0.1
        seekers.proposed(peer)
    assert seekers.hints_for("d") == ["c", "b", "a"]
    seekers.hinted(["x"])
    assert seekers.fresh() == {"a", "b", "c", "d", "x"}
    assert "x" not in seekers.hints_for("a")  # only first-hand seekers are passed on
    seekers.tried("c")
    assert "c" not in seekers.fresh()
    clock.now += SEEKER_FRESH_S + 0.01
    assert seekers.fresh() == set() and seekers.hints_for("z") == []


def test_the_tables_stay_bounded_whatever_number_of_ids_call():
    seekers = Seekers(Clock())
    for i in range(10 * MAX_TRACKED):
        seekers.proposed(f"p{i}")
        seekers.hinted([f"h{i}"])
    assert len(seekers.fresh()) == 2 * MAX_TRACKED


records = st.builds(PeerRecord, stage=st.integers(0, 1024), spec_hash=st.text(max_size=16),
                    version=st.text(max_size=8),
                    state=st.sampled_from(["joining", "training", "finished", "leaving"]),
                    throughput=st.floats(0, 1e6), queue=st.integers(0, 100), inner_step=st.integers(0, 10**9),
                    seeking=st.booleans(), round_step=st.integers(0, 100), loss=st.none() | st.floats(0, 100),
                    last_error=st.text(max_size=20), reachable=st.booleans())


@given(records)
@settings(max_examples=300, deadline=None)
def test_a_compact_record_reads_back_as_the_record(record):
    compact = record.compact_wire()
    assert PeerRecord.from_wire(compact) == record
    assert set(compact) <= set(record.to_wire())


@given(st.floats(0.0, 600.0) | st.none())
@settings(max_examples=200, deadline=None)
def test_a_refusals_ready_in_round_trips(ready_in_s):
    raw = refusal("not-ready", ["QmA"], ready_in_s)
    got = refusal_ready_in_s(raw)
    assert got is None if ready_in_s is None else abs(got - ready_in_s) <= 1e-3
    assert refusal_hints(raw) == ["QmA"]


@given(anything)
@settings(max_examples=1000, deadline=None)
def test_any_ready_in_field_decodes_or_raises_protocol_error(value):
    raw = encode_frame({"ok": False, "error": "not-ready", "ready_in_s": value})
    try:
        ready_in_s = refusal_ready_in_s(raw)
    except ProtocolError:
        return
    assert ready_in_s is None or 0.0 <= ready_in_s <= 600.0

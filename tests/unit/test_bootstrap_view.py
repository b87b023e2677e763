"""The bootstrap's aggregation of registry records, its Prometheus text, and its HTTP
server's handling of bad requests."""

import asyncio
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families
from swarm_bootstrap.view import SwarmView, prometheus_text

from swarm_node.obs.http import Response, StatusServer
from swarm_node.wire.records import PeerRecord

HASH = "0123456789abcdef"


def rec(stage, **kw):
    return PeerRecord(stage=stage, spec_hash=HASH, version="0.1.0", **kw)


def verified_view(*peers: str, num_stages: int = 2) -> SwarmView:
    """A view whose ``peers`` answered the bootstrap's status request."""
    view = SwarmView("r", HASH, num_stages=num_stages)
    for peer in peers:
        view.mark_verified(peer)
    return view


def test_tokens_per_second_ignores_peers_that_left():
    view = verified_view("a", "b", "c")
    view.ingest(100.0, {"a": rec(0, tokens=1000), "b": rec(0, tokens=500), "c": rec(1, loss=3.0)})
    # b left: its tokens do not go negative
    view.ingest(102.0, {"a": rec(0, tokens=1600), "c": rec(1, loss=2.5)})
    assert view.history[-1]["tokens_per_s"] == pytest.approx(300.0)
    assert view.tokens_total == 2100 and view.swarm_loss() == 2.5


def test_failures_are_recorded_from_record_changes():
    view = SwarmView("r", HASH, num_stages=2)
    view.ingest(1.0, {"a": rec(0), "b": rec(1), "c": rec(1, state="training")})
    view.ingest(2.0,
                {"a": rec(0, lost=2, last_error="micro-batch lost: timeout"), "b": rec(1, local_rounds=1),
                 "c": rec(1, state="leaving")})
    view.ingest(3.0, {"a": rec(0, lost=2, last_error="micro-batch lost: timeout")})  # b missing, c left
    assert len(view.failures) == 2  # one poll without a record may be a DHT hiccup
    view.ingest(4.0, {"a": rec(0, lost=2, last_error="micro-batch lost: timeout")})  # b vanished
    what = [f["what"] for f in view.failures]
    assert what[0].startswith("lost 2 micro-batches") and "without a partner" in what[1]
    assert what[2].startswith("vanished") and len(what) == 3 and view.failures_total == 3


def test_joins_leaves_and_vanishings_are_reported_for_the_log():
    view = SwarmView("r", HASH, num_stages=2)
    assert view.ingest(1.0, {"abcdef": rec(0), "ghijkl": rec(1)}) == [
        "peer abcdef joined stage 0 (version 0.1.0)",
        "peer ghijkl joined stage 1 (version 0.1.0)",
    ]
    assert view.ingest(1.5, {"abcdef": rec(0),
                             "ghijkl": rec(0)}) == ["peer ghijkl moved from stage 1 to stage 0"]
    assert view.ingest(2.0, {"abcdef": rec(0, state="leaving")}) == ["peer abcdef of stage 0 is leaving"]
    assert view.ingest(3.0, {}) == ["peer ghijkl of stage 0 vanished without leaving"]


def test_a_peer_missing_from_one_poll_only_is_no_failure():
    view = SwarmView("r", HASH, num_stages=1)
    view.ingest(1.0, {"a": rec(0)})
    view.ingest(2.0, {})
    view.ingest(3.0, {"a": rec(0)})
    view.ingest(4.0, {"a": rec(0)})
    assert view.failures_total == 0


def test_records_of_another_spec_or_stage_are_not_shown():
    view = SwarmView("r", HASH, num_stages=2)
    other = PeerRecord(stage=0, spec_hash="ffffffffffffffff", version="0.1.0")
    view.ingest(1.0, {"a": rec(0), "x": other, "y": rec(7)}, foreign=1)
    assert set(view.peers) == {"a"} and view.foreign_records == 3


def test_prometheus_text_parses_and_carries_the_swarm():
    view = verified_view("a", "b")
    view.ingest(1.0, {"a": rec(0, tokens=10, throughput=5.5, inner_step=7, recent_steps=7),
                      "b": rec(1, loss=2.25, lost=1, last_error='quote " and \\ and \n newline')})
    text = prometheus_text(view, up=True, peer_id="QmBoot", version="0.1.0", now_s=5.0)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name,
                tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("swarm_peers", (("stage", "0"), ("state", "training")))] == 1
    assert samples[("swarm_peers", (("stage", "1"), ("state", "starting")))] == 1  # b never made progress
    assert samples[("swarm_peer_inner_step", (("peer", "a"), ("stage", "0")))] == 7
    assert samples[("swarm_train_loss", ())] == 2.25
    assert samples[("swarm_peer_microbatches_lost_total", (("peer", "b"), ("stage", "1")))] == 1
    assert families["swarm_tokens"].type == "counter"
    empty = prometheus_text(SwarmView("r", HASH, 2), up=False, peer_id="Qm", version="0", now_s=0.0)
    nan = [
        s.value
        for f in text_string_to_metric_families(empty)
        for s in f.samples
        if s.name == "swarm_train_loss"
    ]
    assert math.isnan(nan[0])


async def _request(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def test_status_server_answers_get_and_closes_on_bad_requests():
    async def scenario():
        server = StatusServer({"/healthz": lambda: Response(200, b"ok\n")})
        port = await server.start("127.0.0.1", 0)
        try:
            ok = await _request(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await _request(port, b"HEAD /healthz HTTP/1.1\r\n\r\n")
            post = await _request(port, b"POST /healthz HTTP/1.1\r\n\r\n")
            missing = await _request(port, b"GET /nope HTTP/1.1\r\n\r\n")
            garbage = await _request(port, b"\x00\xff garbage\r\n\r\n")
            huge = await _request(port, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n")
            after = await _request(port, b"GET /healthz?x=1 HTTP/1.0\r\n\r\n")
        finally:
            await server.close()
        return ok, head, post, missing, garbage, huge, after

    ok, head, post, missing, garbage, huge, after = asyncio.run(scenario())
    assert ok.startswith(b"HTTP/1.1 200 OK") and ok.endswith(b"\r\n\r\nok\n")
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")
    assert post.startswith(b"HTTP/1.1 405") and missing.startswith(b"HTTP/1.1 404")
    assert garbage == b"" and huge == b""  # closed without an answer
    assert after.startswith(b"HTTP/1.1 200")  # still serving


def test_a_peer_is_shown_training_only_while_it_makes_progress():
    """A record saying "training" at step 0 with every micro-batch lost is no training
    peer (the defect: a dashboard listed nodes that trained nothing as training)."""
    view = SwarmView("r", HASH, num_stages=2)
    def shown():
        return {p["short_id"]: p["state"] for s in view.status()["stages"] for p in s["peers"]}
    view.ingest(0.0, {"a": rec(0, lost=5), "b": rec(1, state="joining")})
    assert shown() == {"a": "starting", "b": "joining"}
    view.ingest(2.0, {"a": rec(0, inner_step=3, recent_steps=3), "b": rec(1, recent_microbatches=4)})
    assert shown() == {"a": "training", "b": "training"}
    view.ingest(4.0, {"a": rec(0, inner_step=5, recent_steps=5), "b": rec(1, recent_microbatches=4)})
    # a's own last minute shows nothing any more, and we saw no step since: stuck
    for t in (20.0, 30.0):
        view.ingest(t, {"a": rec(0, inner_step=5), "b": rec(1, recent_microbatches=4)})
    assert shown() == {"a": "stalled", "b": "training"}
    view.ingest(32.0, {"a": rec(0, inner_step=6), "b": rec(1, recent_microbatches=4)})  # a step seen by us
    assert shown()["a"] == "training"
    assert view.status()["stages"][0]["peers"][0]["reachable"] is True


def test_unverified_records_are_listed_marked_and_move_no_figure():
    """A red team's forged records (and one liar reporting loss 53) moved the shown swarm
    loss from about 2.1 to 19 and were counted as peers. Only peers that answered the
    bootstrap count, and the loss is a median."""
    view = verified_view("honest0", "honest1", "liar", "feeder")
    forged = {f"forged{i}": rec(1, loss=0.001, tokens=10**9, throughput=1e9) for i in range(30)}
    records = {"honest0": rec(1, loss=2.1), "honest1": rec(1, loss=2.2), "liar": rec(1, loss=53.0),
               "feeder": rec(0, tokens=100), "forged-feeder": rec(0, tokens=10**12), **forged}
    view.ingest(1.0, records)
    view.ingest(3.0, {**records, "feeder": rec(0, tokens=300)})
    status = view.status()
    assert status["num_peers"] == 4 and status["unverified_peers"] == 31
    assert status["loss"] == 2.2 and view.tokens_total == 300
    assert view.history[-1]["tokens_per_s"] == 100.0  # 200 tokens in 2 s, from the verified feeder only
    shown = {p["peer_id"]: p["verified"] for stage in status["stages"] for p in stage["peers"]}
    assert shown["forged7"] is False and shown["honest0"] is True and len(shown) == 35
    assert status["stages"][1]["throughput_samples_per_s"] == 0.0  # claims of the unverified are not summed
    view.mark_verified("forged7")  # it answered after all: it counts from now on
    assert view.status()["num_peers"] == 5

"""The cost model of bench.wire_bytes against hand-computed values, and its exact frame
sizes against the codec."""

import pytest

from bench.wire_bytes.benchmark import (
    CheckRun,
    ModelSize,
    Setting,
    butterfly_share,
    frame_sizes,
    method_rows,
    pair_exchange_bytes,
    pipeline_bytes_per_token,
    predicted_sent,
    refused_requests,
)


def test_hand_computed_costs():
    assert pair_exchange_bytes(1000, "fp16") == 4000  # phi and Delta, 2 bytes each
    assert pair_exchange_bytes(1000, "fp32") == 8000
    assert butterfly_share(2) == 1.0
    assert butterfly_share(8) == pytest.approx(1.75)
    assert pipeline_bytes_per_token(64) == 2 * 64 * 2 + 4  # fp16 activation and gradient, int32 target


def test_method_rows_per_token():
    size = ModelSize("m", "project", params=1000, hidden=10, tokens_per_step=100)
    rows = {r["method"]: r for r in method_rows(size, Setting(peers=4, noloco_inner_steps=50,
                                                                  diloco_inner_steps=100))}
    assert rows["noloco"]["bytes_per_sync"] == 4000
    assert rows["noloco"]["bytes_per_token"] == pytest.approx(4000 / (50 * 100))
    assert rows["noloco"]["per_token_vs_reference"] == pytest.approx(0.5)
    assert rows["diloco-allreduce"]["bytes_per_sync"] == 1.5 * 4000
    assert rows["diloco-here"]["bytes_per_sync"] == 3 * 4000
    assert rows["ddp"]["bytes_per_token"] == pytest.approx(1.5 * 4000 / 100)
    assert rows["pipeline"]["bytes_per_token"] == 44


def test_frames_match_the_payload_plus_a_small_header():
    run = CheckRun(stages=2, replicas=2, model="debug", batch_size=2, seq_len=8)
    sizes = frame_sizes(run)
    tokens = 2 * 8
    assert 0 < sizes["forward"] - tokens * (64 * 2 + 4) < 200
    assert 0 < sizes["gradient"] - tokens * 64 * 2 < 200
    sent = predicted_sent({"stage": 0, "rounds_with_partner": 3, "microbatches_done": 5, "retries": 1}, sizes,
                          2)
    assert sent == 3 * sizes["outer0"] + 6 * sizes["forward"]
    sent = predicted_sent({"stage": 1, "rounds_with_partner": 0, "microbatches_done": 5, "retries": 0}, sizes,
                          2)
    assert sent == 5 * sizes["gradient"]


def test_declined_requests_show_as_whole_outer_frames():
    sizes = {"outer0": 1000, "forward": 10, "gradient": 10}
    peer = {"stage": 0, "rounds_with_partner": 3, "microbatches_done": 0, "retries": 0,
            "bytes_sent": 7 * 1000 + 44}
    assert refused_requests(peer, sizes, 1) == 4

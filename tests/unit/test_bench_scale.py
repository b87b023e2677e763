"""The scale benchmark's plan, table and verdict, from rows alone (the runs themselves
are the simulator's, tested in tests/inproc/test_scale.py)."""

from bench.scale.benchmark import PLANS, shards_for
from bench.scale.report import markdown


def _row(label, peers, **over):
    row = {"kind": "run", "label": label, "peers_per_stage": peers, "registry_shards": shards_for(peers),
           "method": "diloco" if label == "diloco" else "noloco", "rounds": 100, "partner_share": 0.99,
           "alone_rounds": 0, "proposals_per_round": 2.0, "refusals_per_round": 1.0, "to_partner_median_s": 0.1,
           "to_partner_p99_s": 1.0, "to_partner_median_rtts": 2.0, "round_median_s": 1.0, "idle_per_round_s": 0.0,
           "control_bytes_per_peer_min_median": 300e3, "control_bytes_per_peer_min_p99": 400e3,
           "control_bytes_per_peer_min_max": 500e3, "control_by_kind_per_peer_min": {"dht-get": 100e3},
           "forwards": 10, "forwards_to_dead_share": 0.01, "forwards_to_unreachable_share": 0.0,
           "forwards_lost_share": 0.0, "crashes": 1, "leaves": 0, "joins": 1, "window_s": 100.0, "real_s": 3.0}
    return row | over


def _result(rows):
    return {"mode": "quick", "wall_s": 10.0, "machine": {"cpu_count": 2}, "rows": rows, "notes": [],
            "summary": {"duration_s": 480.0, "scenario": {"stages": 2}}}


def test_shards_give_a_read_about_four_records():
    assert [shards_for(n) for n in (2, 8, 16, 64, 1024)] == [1, 2, 4, 16, 256]
    assert {c.peers for c in PLANS["full"].cases} >= {16, 64, 256, 1024}
    assert all(c.peers <= 64 for c in PLANS["quick"].cases if c.label != "noloco")


def test_the_verdict_at_the_largest_n_says_which_bar_holds():
    good = markdown(_result([_row("noloco", 16), _row("noloco", 1024)]))
    assert "At N = 1024 a stage" in good and good.count("**yes**") == 3 and "**no**" not in good
    slow = markdown(_result([_row("noloco", 1024, to_partner_median_rtts=9.0,
                                  control_bytes_per_peer_min_max=900e3)]))
    assert slow.count("**no**") == 2 and "| noloco | 1024 | 256 |" in slow

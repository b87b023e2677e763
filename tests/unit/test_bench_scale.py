"""The scale benchmark's plan, table and verdict, from rows alone (the runs themselves
are the simulator's, tested in tests/inproc/test_scale.py)."""

from bench.scale.benchmark import PLANS, shards_for
from bench.scale.report import markdown


def _row(label, peers, **over):
    row = {"kind": "run", "label": label, "peers_per_stage": peers, "registry_shards": shards_for(peers),
           "method": "diloco" if label == "diloco" else "noloco", "rounds": 100, "partner_share": 0.99,
           "alone_rounds": 0, "proposals_per_round": 2.0, "refusals_per_round": 1.0,
           "to_partner_median_s": 0.1,
           "to_partner_p99_s": 1.0, "to_partner_median_rtts": 2.0, "round_median_s": 1.0,
           "idle_per_round_s": 0.0,
           "control_bytes_per_peer_min_median": 300e3, "control_bytes_per_peer_min_p99": 400e3,
           "control_bytes_per_peer_min_max": 500e3, "control_by_kind_per_peer_min": {"dht-get": 100e3},
           "forwards": 10, "forwards_to_dead_share": 0.01, "forwards_to_unreachable_share": 0.0,
           "forwards_lost_share": 0.0, "crashes": 1, "leaves": 0, "joins": 1, "window_s": 100.0,
           "real_s": 3.0}
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


def test_the_real_run_is_figured_from_the_nodes_logs_and_summaries(tmp_path):
    """Rounds 0 and 1 are left out of the partner share, as the simulator's warm-up;
    proposals and registry operations come from every node's summary."""
    import json

    from bench.scale.processes import real_figures, round_outcomes

    log = ("12:00:01 I swarm_node.gossip.exchange: round 0: no other peer in our stage; local-only steps\n"
           "12:00:02 I swarm_node.gossip.exchange: round 1: averaged with abc123 in 0.20s\n"
           "12:00:03 I swarm_node.gossip.exchange: round 2: averaged with abc123 in 0.20s\n"
           "12:00:04 I swarm_node.gossip.exchange: round 3: no partner found in 15.0s, local-only step\n")
    assert round_outcomes(log) == [(0, False), (1, True), (2, True), (3, False)]
    for i in range(2):
        (tmp_path / f"node-s0-r{i}.log").write_text(log)
        (tmp_path / f"summary-stage0-{i}.json").write_text(json.dumps(
            {"rounds_with_partner": 2, "local_only_rounds": 2, "proposals_sent": 6, "proposals_refused": 2,
             "training_wall_s": 120.0, "inner_steps": 40, "dht_gets": 60, "dht_entries_read": 240,
             "dht_stores": 20,
             "microbatches_lost": 0, "bytes_sent": 1200, "proposal_s": 3.0, "dht_get_s": 30.0,
             "dht_store_s": 40.0,
             "round_prepare_s": 4.0 + i, "round_close_s": 2.0, "round_exchange_s": 1.0, "round_exchanges": 2,
             "proposals_refused_busy": 1}))
    figures = real_figures(tmp_path, {"final_val_loss": 2.5})
    assert figures["rounds_in_window"] == 4 and figures["partner_share"] == 0.5
    assert figures["proposals_per_round"] == 1.5 and figures["refusals_per_round"] == 0.5
    assert figures["registry_ops_per_peer_min"] == {"gets": 30.0, "entries_read": 120.0, "stores": 10.0}
    assert figures["step_s_median"] == 3.0
    assert (figures["proposal_s_mean"], figures["dht_get_s_mean"], figures["dht_store_s_mean"]) == (0.5, 0.5,
                                                                                                    2.0)
    assert figures["step_s_log_sigma"] == 0.0  # both nodes stepped alike
    assert (figures["round_prepare_s_mean"], figures["round_close_s_mean"],
            figures["round_exchange_s_mean"]) == \
        (9.0 / 8, 0.5, 0.5)
    assert figures["refused_busy_share"] == 0.5


def test_the_section_shows_the_real_processes_beside_both_simulators():
    from bench.scale.report import _processes

    real = {"kind": "real", "nodes": 32, "stages": 2, "peers_per_stage": 16, "inner_steps": 10,
            "registry_shards": 4, "rounds_in_window": 600, "partner_share": 0.9, "proposals_per_round": 8.5,
            "refusals_per_round": 8.0, "proposal_s_mean": 0.77, "dht_get_s_mean": 1.2,
            "dht_store_s_mean": 2.5, "step_s_median": 2.6, "microbatches_lost": 0,
            "registry_ops_per_peer_min": {"gets": 9.0, "entries_read": 30.0, "stores": 11.0}}
    sim = {"kind": "simulated", "rounds": 700, "partner_share": 0.94, "proposals_per_round": 6.0,
           "refusals_per_round": 5.5,
           "registry_ops_per_peer_min": {"gets": 9.5, "entries_read": 35.0, "stores": 10.0}}
    rows = [real, {"kind": "memory", "process": "node", "count": 32, "pss_mb_median": 218.0,
                   "pss_mb_max": 281.0},
            sim | {"links": "loopback", "rtt_ms": 0.1, "record_delay_s": [0.05, 0.5]},
            sim | {"links": "calibrated", "rtt_ms": 770.0, "record_delay_s": [0.05, 0.5], "dht_get_s": 1.2,
                   "dht_store_s": 2.5}]
    verdict = {"partner_share": {"real": 0.9, "simulated": 0.94, "points_apart": 4.0},
               "proposals_per_round": {"real": 8.5, "simulated": 6.0, "ratio": 0.71}}
    text = _processes({"command": "python -m bench.scale.processes", "wall_s": 800.0, "rows": rows,
                       "notes": [],
                       "summary": {"loopback": verdict, "calibrated": verdict}})
    assert (
        "| real processes |" in text
        and "calibrated: round trips 770 ms" in text
        and "loopback: round trips" in text
    )
    assert "4.0 points apart" in text and "| node | 32 | 218 | 281 |" in text


def test_the_section_holds_the_rounds_against_the_latency_model():
    from bench.scale.report import _against_latency_model

    rows = [{"label": "noloco", "peers_per_stage": 16, "to_partner_median_rtts": 1.0, "round_median_s": 1.5},
            {"label": "noloco", "peers_per_stage": 1024, "to_partner_median_rtts": 1.0,
             "round_median_s": 1.7},
            {"label": "diloco", "peers_per_stage": 16, "round_median_s": 16.9}]
    model = {"summary": {"allreduce_ratio_at_1024": {"N = 1024, std/t = 0": 10.0,
                                                     "N = 1024, std/t = 1": 17.0}}}
    text = _against_latency_model(rows, model)
    assert "1.0 round trips and the median round 1.50-1.70 s from 16 to 1024 peers" in text
    assert "10x a pair (std/t = 0), 17x a pair (std/t = 1) at N = 1024" in text
    assert "16.9 s at N = 16" in text and "against NoLoCo's 1.5 s." in text
    assert _against_latency_model([], model) == ""

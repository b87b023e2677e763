"""The sync-cost benchmark's pure logic: round statistics, the summary the latency model
reads, the seeking board and the report (no peers started), and its hosts on the test bed."""

import random
import subprocess

import pytest

from bench.sync_cost import benchmark as sync_cost
from bench.sync_cost import net as sync_cost_net
from bench.sync_cost.ipc import SeekingBoard
from tests.netbed.bed import tbf_args

PLAN = sync_cost.Plan(settings=(sync_cost.Setting("loopback", None, ((1_000_000, (2, 4)),)),),
                      plain_rounds=1, straggler_rounds=1, message_repeats=1, inner_phase_s=1.0,
                      slow_factor=3.0)
LOOPBACK = PLAN.settings[0]


def test_stragglers_are_the_last_quarter_and_at_least_one():
    assert sync_cost.stragglers([0, 1]) == [1]
    assert sync_cost.stragglers([0, 1, 2, 3]) == [3]
    assert sync_cost.stragglers(list(range(8))) == [6, 7]
    assert PLAN.straggler_delay_s == 2.0
    assert sync_cost.delays([0, 1, 2, 3], [3], 2.0) == {0: 0.0, 1: 0.0, 2: 0.0, 3: 2.0}


def test_round_stats_critical_path_and_idle():
    answers = {0: {"ready": 10.0, "end": 10.5}, 1: {"ready": 12.0, "end": 12.25}}
    stats = sync_cost.round_stats(answers)
    assert stats["round_s"] == 2.25
    assert stats["idle"] == {0: 0.5, 1: 0.25}


def test_matched_roles_pair_everyone_once_with_one_sender():
    roles = sync_cost.matched_roles(list(range(8)), random.Random(3))
    assert sorted(roles) == list(range(8))
    for rank, role in roles.items():
        assert roles[role["partner"]]["partner"] == rank
        assert role["initiate"] != roles[role["partner"]]["initiate"]


def test_round_row_marks_stragglers_and_counts_failed_rounds():
    outcomes = [{"failed": False, "round_s": 1.0, "idle": {0: 0.2, 1: 0.4}, "attempts": 1, "exchange_s": 0.1,
                 "compute_s": 0.05},
                {"failed": False, "round_s": 3.0, "idle": {0: 0.4, 1: 0.6}, "attempts": 2, "exchange_s": 0.3,
                 "compute_s": 0.05},
                {"failed": True, "attempts": 3}]
    row = sync_cost.round_row(LOOPBACK, 10, [0, 1], "pair", [1], 2.0, outcomes)
    assert row["round_s"] == 2.0 and row["max_idle_s"] == 0.5 and row["attempts"] == 2.0
    assert row["idle_by_peer_s"] == "0.30 0.50*" and row["rounds"] == 2 and row["failed"] == 1
    failed = sync_cost.round_row(LOOPBACK, 10, [0, 1], "allreduce", [], 0.0, [{"failed": True}])
    assert failed["round_s"] is None and failed["matchmaking_s"] is None and failed["failed"] == 1


def _rows():
    def rnd(peers, method, slow, round_s, idle):
        extra = ({"matchmaking_s": 1.0} if method == "allreduce"
                 else {"exchange_s": 0.2, "attempts": 1.5 if method == "pair" else 0.5, "compute_s": 0.1})
        return {"table": "round", "setting": "loopback", "rate_mbit": 0, "params": 1_000_000, "peers": peers,
                "method": method, "stragglers": slow, "delay_s": 2.0 if slow else 0.0, "rounds": 1,
                "failed": 0,
                "round_s": round_s, "mean_idle_s": idle, "max_idle_s": idle, "idle_by_peer_s": "0.10 0.20*",
                **extra}
    rows = [{"table": "message", "setting": "loopback", "rate_mbit": 0, "params": 1_000_000,
             "frame_bytes": 4_000_100, "message_s": 0.1, "mbit_per_s": 320.0}]
    for peers, (pair, matched, allreduce) in ((2, (0.5, 0.25, 0.25)), (4, (1.0, 0.25, 1.0))):
        for method, value in zip(("pair", "pair_matched", "allreduce"), (pair, matched, allreduce)):
            rows += [rnd(peers, method, 0, value, value), rnd(peers, method, 1, value + 2, value + 1)]
    return rows


def test_summary_has_the_keys_the_latency_model_reads():
    summary = sync_cost.summarize(_rows(), PLAN)
    assert summary["message_time_s"] == {"loopback": {"1000000": 0.1}}
    assert summary["message_bytes"] == {"1000000": 4_000_100}
    assert summary["round_time_s"]["loopback"]["1000000"]["4"] == {
        "pair": 1.0, "pair_matched": 0.25, "allreduce": 1.0, "allreduce_with_matchmaking": 2.0}
    assert summary["allreduce_over_pair"]["loopback"]["1000000"] == {"2": 0.5, "4": 1.0}
    assert summary["allreduce_over_matched_pair"]["loopback"]["1000000"] == {"2": 1.0, "4": 4.0}
    assert summary["straggler_idle_s"]["loopback"]["1000000"]["4"] == {
        "pair": 2.0, "pair_matched": 1.25, "allreduce": 2.0}
    assert summary["straggler_delay_s"] == 2.0


def test_markdown_is_rendered_from_the_result_only():
    rows = _rows()
    result = {"mode": "quick", "wall_s": 99.0, "machine": {"cpu_count": 2}, "rows": rows,
              "summary": sync_cost.summarize(rows, PLAN), "notes": ["a caveat"]}
    text = sync_cost.markdown(result)
    assert "bench/results/sync_cost.png" in text and "python -m bench.sync_cost" in text
    assert "1.00x to 4.00x a matched pair round's" in text  # computed from the rows
    assert "faster in 1 of 2 configurations." in text and "the measured gap is smaller" not in text
    assert "1.5 proposals each" in text and "- a caveat" in text
    assert "| loopback | 1M | 4 | 1.00 | 1.5 | 0.25 | 0.20 | 1.00 | 1.00 | 1.00 | 4.00 |" in text


def test_the_benchmark_peers_live_on_hosts_of_the_test_bed_with_ethernet_frames():
    if sync_cost_net.available():
        pytest.skip(sync_cost_net.available())
    with sync_cost_net.Namespaces(2) as namespaces:
        prefixes = [namespaces.exec_prefix(rank) for rank in range(2)]
        addresses = [namespaces.address(rank) for rank in range(2)]
        namespaces.shape(50)
        mtu = subprocess.run([*prefixes[0], "cat", "/sys/class/net/eth0/mtu"], capture_output=True,
                             text=True).stdout
    assert all(p[:3] == ["ip", "netns", "exec"] and p[3].startswith("snb-") for p in prefixes)
    assert len(set(addresses)) == 2 and mtu.strip() == "1500"
    assert tbf_args(200)[:3] == ["tbf", "rate", "200mbit"] and int(tbf_args(1)[4]) >= 64 * 1024


def test_seeking_board_round_trip(tmp_path):
    path = tmp_path / "board"
    SeekingBoard.create(path, 3)
    writer, reader = SeekingBoard(path, 3), SeekingBoard(path, 3)
    writer.set(2, 41)
    assert [reader.get(r) for r in range(3)] == [0, 0, 41]

"""The arithmetic of bench/swarm_efficiency/benchmark.py: steady-state windows, step times, profile
buckets, /proc parsing and CPU accounting, and the report rendered from a result."""


import pytest

from bench.swarm_efficiency import analysis as ana
from bench.swarm_efficiency.benchmark import markdown

WORKER = "/x/swarm_node/train/worker.py"
MODULE = "/x/torch/nn/modules/module.py"


def test_steady_window_is_where_every_node_is_between_the_steps():
    times = [[1.0, 2.0, 3.0, 4.0, 5.0], [1.5, 2.5, 3.5, 4.5, 5.5]]
    assert ana.steady_window(times, 2, 4) == (2.5, 4.0)
    with pytest.raises(ValueError):
        ana.steady_window(times, 2, 6)


def test_count_between_interpolates_the_cumulative_amount():
    times, amounts = [1.0, 2.0, 3.0], [8, 8, 8]
    assert ana.count_between(times, amounts, 1.5, 3.0) == pytest.approx(12.0)
    # before the first event: nothing
    assert ana.count_between(times, amounts, 0.0, 1.0) == pytest.approx(8.0)
    assert ana.count_between([], [], 0.0, 1.0) == 0.0


def test_step_intervals_leave_out_rounds_and_the_outside_of_the_window():
    steps = [0.0, 1.0, 2.0, 5.0, 6.0, 7.5]
    intervals = ana.interval_stats(steps, [[2.5, 4.5]], start=0.5, end=7.0)
    # 0->1 starts before the window, 2->5 spans the round, 6->7.5 ends after it
    assert intervals == [1.0, 1.0]
    stats = ana.mean_std([1.0, 2.0, 3.0])
    assert stats["mean"] == 2.0 and stats["std"] == pytest.approx(1.0) and stats["n"] == 3
    assert ana.mean_std([])["mean"] is None


def _entry(own: float, cumulative: float, callers: dict | None = None) -> tuple:
    return (1, 1, own, cumulative, callers or {})


def test_compute_buckets_split_recompute_and_avoid_double_counting():
    backward = (WORKER, 80, "backward")
    forward = (WORKER, 60, "forward")
    step = (WORKER, 100, "step")
    check = ("/x/swarm_node/gossip/partner_check.py", 1, "check")
    stats = {forward: _entry(0.1, 2.0), backward: _entry(0.1, 5.0),
             (MODULE, 1, "_wrapped_call_impl"): _entry(2.0, 4.0,
                                                       {forward: (1, 1, 1.0, 1.9),
                                                        backward: (1, 1, 1.0, 2.0)}), step: _entry(1.0, 1.0),
             ("/x/swarm_node/wire/frames.py", 1, "encode_frame"): _entry(0.5, 0.5), check: _entry(0.1, 0.4),
             ("/x/swarm_node/gossip/partner_check.py", 2, "norm"): _entry(0.3, 0.3,
                                                                          {check: (1, 1, 0.2, 0.2)}),
             ("~", 0, "<method 'get' of '_queue.SimpleQueue' objects>"): _entry(50.0, 50.0),
             ("/x/other.py", 1, "check"): _entry(6.0, 6.0),}
    buckets = ana.compute_buckets(stats)
    assert buckets["recompute"] == pytest.approx(2.0)
    assert buckets["useful"] == pytest.approx(2.0 + 5.0 + 1.0 - 2.0)
    assert buckets["serialisation"] == pytest.approx(0.5)
    assert buckets["outer"] == pytest.approx(0.4 + 0.3 - 0.2)  # norm inside check counted once
    busy = 0.1 + 0.1 + 2.0 + 1.0 + 0.5 + 0.1 + 0.3 + 6.0  # own times, the idle wait excluded
    assert sum(buckets.values()) == pytest.approx(busy)
    assert sum(ana.shares(buckets).values()) == pytest.approx(1.0)


def test_proc_parsers():
    assert ana.parse_stat("123 (my (odd) name) S 45 123 123 0 -1") == ("my (odd) name", 45)
    assert ana.parse_schedstat("2000000000 500000000 17\n") == (2.0, 0.5)
    busy, idle = ana.parse_cpu_line("cpu  100 0 50 300 20 0 5 25 0 0", 100)
    assert (busy, idle) == (pytest.approx(1.8), pytest.approx(3.2))


def _sample(t: float, busy: float, idle: float, cpu: dict[int, float]) -> ana.Sample:
    # driver 10 -> node 20 (threads 20, 21) -> DHT 30 -> p2pd 40; driver's p2pd 50
    tree = {20: (20, 10, "python"), 21: (20, 10, "python"), 30: (30, 20, "python"), 40: (40, 30, "p2pd"),
            10: (10, 1, "python"), 50: (50, 10, "p2pd")}
    tasks = {tid: ana.TaskStat(pid, ppid, comm, cpu[tid], cpu[tid] / 10) for tid, (pid, ppid,
                                                                                   comm) in tree.items()}
    return ana.Sample(t, busy, idle, tasks)


def test_cpu_accounting_by_role_and_stage():
    before = {20: 1.0, 21: 1.0, 30: 1.0, 40: 1.0, 10: 1.0, 50: 1.0}
    after = {20: 2.0, 21: 1.5, 30: 1.25, 40: 1.5, 10: 1.2, 50: 1.1}
    samples = [_sample(0.0, 10.0, 10.0, before), _sample(2.0, 14.0, 10.0, after)]
    nodes = {20: ana.NodeThreads(20, 1, compute_tid=21)}
    cpu = ana.cpu_accounting(samples, nodes, 0.0, 2.0)
    assert cpu["roles"] == pytest.approx({"compute": 0.5, "event_loop": 1.0, "dht": 0.25, "p2pd": 0.6,
                                          "driver": 0.2})
    assert cpu["stages"][1] == pytest.approx({"compute": 0.5, "compute_wait": 0.05, "event_loop": 1.0,
                                              "dht": 0.25, "p2pd": 0.5})
    assert (cpu["machine_busy"], cpu["machine_idle"]) == (4.0, 0.0)


def test_markdown_is_rendered_from_the_result_alone():
    machine = {c: 0.05 for c in ("useful", "recompute", "serialisation", "outer", "other", "event_loops",
                                 "dht",
                                 "p2pd", "driver", "other_processes", "idle")}
    result = {
        "command": "python bench/swarm_efficiency/__main__.py", "mode": "quick", "notes": ["a note"],
        "rows": [{"table": "throughput", "layout": "plain, 4 threads", "tokens_per_s": 1000.0, "ratio": 1.0},
                 {"table": "throughput", "layout": "2x2", "tokens_per_s": 700.0, "ratio": 0.7,
                  "ratio_cores": 0.6,
                  "outer_rounds": 8, "rounds_with_partner": 6, "round_time_mean_s": 2.5},
                 {"table": "machine", "layout": "plain, 4 threads", **machine, "useful": 0.9},
                 {"table": "machine", "layout": "2x2", **machine, "useful": 0.5},
                 {"table": "stages", "layout": "2x2", "stage": 0, "useful": 0.4, "idle": 0.3}],
        "summary": {"model": "tiny", "num_parameters": 3_000_000, "seq_len": 128, "batch_size": 8,
                    "inner_steps": 20,
                    "window_steps": [10, 60], "round_timeout_s": 15.0, "plain_threads": 4, "cores": 2,
                    "tokens_per_s_plain": 1000.0,
                    "tokens_per_s_plain_cores": 1100.0, "tokens_per_s": {"2x2": 700.0}, "ratio": {"2x2": 0.7},
                    "ratio_cores": {"2x2": 0.6}, "cpu_ratio": {"2x2": 0.8}, "daemon_cpu_share": {"2x2": 0.1},
                    "other_processes_max": 0.3,
                    "step_time_s": {"mean": 0.2, "std": 0.05, "n": 90, "layout": "2x2"}},
    }
    text = markdown(result)
    assert text.startswith("## Swarm efficiency")
    assert "0.70x** plain" in text and "falls short of plain training by 30%" in text
    assert "bench/results/swarm_efficiency.png" in text and "up to 30% of the machine" in text
    assert "only 6 of 8 outer rounds found a partner" in text
    assert "- a note" in text and ".venv/bin/python -m bench.swarm_efficiency\n" in text


def test_the_fast_link_section_compares_libp2p_with_lanes():
    from bench.swarm_efficiency.report import fast_link_section

    rows = [{"table": "fast_link", "path": path, "tokens_per_s": tps, "transport_share": share,
             "p2pd_share": 0.1,
             "node_io_share": share - 0.1, "compute_share": 0.5, "idle_share": 0.1, "stage0_blocked": 0.2,
             "mb_per_s_whole_run": 30.0, "step_time_mean_s": 0.2, "microbatches_lost": 0,
             "other_processes": 0.0}
            for path, tps, share in (("libp2p streams", 4000.0, 0.4), ("direct lanes", 6000.0, 0.15))]
    result = {"rows": rows, "summary": {"fast_link": {
        "model": "debug", "seq_len": 512, "batch_size": 16, "speedup": 1.5,
        "tokens_per_s": {"libp2p streams": 4000.0, "direct lanes": 6000.0},
        "transport_share": {"libp2p streams": 0.4, "direct lanes": 0.15}}}}
    text = "\n".join(fast_link_section(result))
    assert "| libp2p streams | 4,000 | 40% |" in text and "| direct lanes | 6,000 | 15% |" in text
    assert "1.50x the tokens/s of libp2p streams" in text and "40 % before, 15 % after" in text


def test_the_fast_link_paths_take_turns_and_each_row_is_the_mean_of_its_runs(tmp_path, monkeypatch):
    """A B B A: a machine that speeds up through the sitting favours neither path."""
    from types import SimpleNamespace

    from bench.common.results import Result
    from bench.swarm_efficiency import fast_link
    from bench.swarm_efficiency.report import fast_link_section

    order = []

    def run_swarm(plan, stages, replicas, work_dir, *, lanes):
        order.append(lanes)
        assert work_dir.is_dir() and not any(work_dir.iterdir())  # every run in a folder of its own
        return SimpleNamespace(summary={"peers": [{"bytes_sent": 1e6}], "wall_s": 1.0},
                               tokens_per_s=1000.0 * len(order))  # each run faster than the one before

    def analyse_swarm(swarm, plan):
        machine = {k: 0.1 for k in ("p2pd", "event_loops", "useful", "recompute", "serialisation", "outer",
                                    "other", "idle", "other_processes")}
        return SimpleNamespace(machine=machine, stages=[{"stage": 0, "idle": 0.2}],
                               throughput={"tokens_per_s": swarm.tokens_per_s, "step_time_mean_s": 0.1,
                                           "microbatches_lost": 1})

    monkeypatch.setattr(fast_link, "run_swarm", run_swarm)
    monkeypatch.setattr(fast_link, "analyse_swarm", analyse_swarm)
    result = Result("swarm_efficiency", "quick", tmp_path)
    fast_link.run_fast_link(fast_link.FAST_LINK_QUICK, result, tmp_path)
    assert order == [False, True, True, False]
    rows = {r["path"]: r for r in result.rows}
    assert rows["libp2p streams"]["tokens_per_s"] == 2500.0 and rows["direct lanes"]["tokens_per_s"] == 2500.0
    assert rows["direct lanes"]["tokens_per_s_each"] == [2000.0, 3000.0]
    assert rows["direct lanes"]["microbatches_lost"] == 2 and rows["direct lanes"]["runs"] == 2
    assert result.summary["fast_link"]["speedup"] == 1.0 and result.summary["fast_link"]["runs_each"] == 2
    page = "\n".join(fast_link_section({"rows": result.rows, "summary": result.summary}))
    assert "1.00x the tokens/s of libp2p streams (one path's runs differ by up to 300 % between them)" in page

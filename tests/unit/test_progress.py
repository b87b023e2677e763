"""Progress displays: no placeholder losses, and a final evaluation that says what it does."""

import logging

from swarm_node.obs.progress import EvaluationProgress, TrainingProgress


def test_the_training_bar_shows_no_loss_until_there_is_one(capsys):
    bar = TrainingProgress(10, "swarm")
    bar.update(3, 3000, None, None, 1.0)
    assert "loss" not in bar.bar.postfix and "tok/s" in bar.bar.postfix
    bar.update(5, 5000, 2.5, None, 2.0)
    assert "loss=2.500" in bar.bar.postfix
    bar.close()
    assert "nan" not in capsys.readouterr().err


def test_finish_moves_the_bar_to_the_last_step():
    bar = TrainingProgress(10, "swarm")
    bar.update(9, 0, None, None, 1.0)
    bar.finish(10)
    assert bar.bar.n == 10
    bar.close()


def test_the_final_evaluation_logs_a_line_per_path(caplog):
    log = logging.getLogger("test.eval")
    progress = EvaluationProgress(2, 3, log)
    with caplog.at_level(logging.INFO, logger="test.eval"):
        for what in ("replica 0", "replica 1"):
            progress.start(what)
            for _ in range(3):
                progress.advance()
            progress.finished(what, 2.0, 0.5)
    progress.close()
    assert [r.getMessage() for r in caplog.records] == [
        "evaluated replica 0 (1 of 2): val loss 2.0000 in 0.5 s",
        "evaluated replica 1 (2 of 2): val loss 2.0000 in 0.5 s",
    ]


def test_a_node_status_line_says_step_loss_speed_peers_and_last_round():
    from swarm_node.obs.progress import NodeSnapshot, node_status_line

    line = node_status_line(NodeSnapshot(inner_step=1234, max_steps=5000, loss=2.3104, tokens_per_s=1530.4,
                                         stage=1, num_stages=2, peers_in_stage=3, last_round=24,
                                         last_partner="ab12cd", last_round_ago_s=12.2))
    assert line == "step 1,234/5,000 | loss 2.310 | 1,530 tok/s | stage 1 of 2 with 3 other peers | " \
                   "round 24 with ab12cd 12s ago"
    first = node_status_line(NodeSnapshot(inner_step=0, max_steps=None, loss=None, tokens_per_s=0.0, stage=0,
                                          num_stages=2, peers_in_stage=1,
                                          stalled="no micro-batch came back from stage 1 in the last minute"))
    assert (
        first
        == "step 0 | loss - | 0 tok/s | stage 0 of 2 with 1 other peer | stalled: no micro-batch came back "
        "from stage 1 in the last minute"
    )
    assert "nan" not in first


def test_without_a_terminal_the_node_status_is_a_log_line_a_minute(caplog):
    from swarm_node.obs.progress import NodeProgress, NodeSnapshot

    now = [0.0]
    progress = NodeProgress(logging.getLogger("test.node"), live=False, clock=lambda: now[0])
    snapshot = NodeSnapshot(inner_step=5, max_steps=None, loss=None, tokens_per_s=10.0, stage=0, num_stages=1,
                            peers_in_stage=0, last_round=0, last_partner=None, last_round_ago_s=3.0)
    with caplog.at_level(logging.INFO, logger="test.node"):
        for second in range(1, 121):  # fed every second, logged once a minute
            now[0] = float(second)
            progress.show(snapshot)
    progress.close()
    line = "progress: step 5 | loss - | 10 tok/s | stage 0 of 1 with 0 other peers | round 0 alone 3s ago"
    assert progress.period_s == 1.0 and [r.getMessage() for r in caplog.records] == [line, line]


def test_the_node_feeds_the_line_from_its_components():
    """Stage 0 of two shows the loss the last stage reports back; with nothing done in
    a whole minute it says what it waits for (not before a minute was watched); a
    partner's short id names the round."""
    import asyncio
    from types import SimpleNamespace

    from swarm_node.node.progress_feed import ProgressFeed
    from swarm_node.obs.stats import NodeStats
    from swarm_node.spec import RunSpec

    spec = RunSpec.from_dict({"run_id": "r", "model_size": "debug", "num_stages": 2, "batch_size": 4,
                              "seq_len": 16})
    worker = SimpleNamespace(inner_step=7, loss_ema=None, is_first=True, is_last=False)
    membership = SimpleNamespace(stage=0, live_peers=lambda stage: {"QmOther": None})
    exchange = SimpleNamespace(last=None)
    stats = NodeStats()
    now = [0.0]
    pipeline = SimpleNamespace(loss_seen=2.5, waiting_for_next_stage=False)
    feed = ProgressFeed(spec=spec, max_steps=100, worker=worker, pipeline=pipeline,
                        membership=membership, exchange=exchange, stats=stats, clock=lambda: now[0])

    async def snapshots():
        assert feed.snapshot().stalled is None  # just started: nothing to say yet
        now[0] = 61.0
        pipeline.waiting_for_next_stage = True
        assert feed.snapshot().stalled == "waiting for a stage-1 peer to join"
        pipeline.waiting_for_next_stage = False
        first = feed.snapshot()
        now[0] = 62.0
        stats.microbatches_done += 3
        exchange.last = SimpleNamespace(round_no=4, partners=["Qm" + "x" * 40 + "abc123"],
                                        ended_at=asyncio.get_running_loop().time())
        return first, feed.snapshot()

    first, later = asyncio.run(snapshots())
    assert (first.loss, first.peers_in_stage, first.max_steps) == (2.5, 1, 100)
    assert (
        first.stalled == "no micro-batch came back from stage 1 in the last minute"
        and first.last_round is None
    )
    assert later.stalled is None and (later.last_round, later.last_partner) == (4, "abc123")
    assert later.tokens_per_s > 0  # 3 micro-batches of 4 x 16 tokens over the time between the two

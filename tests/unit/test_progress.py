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
    assert [r.getMessage() for r in caplog.records] == ["evaluated replica 0 (1 of 2): val loss 2.0000 in 0.5 s",
                                                        "evaluated replica 1 (2 of 2): val loss 2.0000 in 0.5 s"]

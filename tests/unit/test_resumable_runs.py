"""A benchmark run stopped part-way goes on from where it was and ends exactly where an
unbroken run ends (bench/convergence/runs.py Resumable): the plans of many CPU-hours are
stopped and started again."""

import pytest
import torch

from bench.convergence import runs
from bench.convergence.plan import Job, Plan

PLAN = Plan(model="debug", steps=9, global_batch=8, seq_len=32, seeds=(0,), grids=((2, 2),), scaling_m=(1,),
            eval_batches=1, inner_steps=(("noloco", 3),), curve_every=3, curve_batches=1)


class Stopped(Exception):
    pass


def _stop_after(step_to_stop: int, monkeypatch):
    """The process is killed once ``step_to_stop`` is done (and saved)."""
    real = runs._train

    def train(sim, every, curve_batches, curve, start, on_step):
        def step_then_maybe_stop(step):
            on_step(step)
            if step == step_to_stop:
                raise Stopped

        return real(sim, every, curve_batches, curve, start, step_then_maybe_stop)

    monkeypatch.setattr(runs, "_train", train)


@pytest.mark.parametrize("method", ["noloco", "ddp"])
def test_a_run_stopped_part_way_ends_where_an_unbroken_run_ends(method, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    job = Job("size", 2, 2, method, 0, PLAN)
    unbroken = runs.run_job(job)
    monkeypatch.setattr(runs, "RESUME_EVERY_S", 0.0)  # saved after every step
    with monkeypatch.context() as patch:
        _stop_after(5, patch)  # mid-round: step 5 of rounds of 3
        with pytest.raises(Stopped):
            runs.run_job(job, resume_dir=tmp_path)
    assert len(list(tmp_path.glob("*.pkl"))) == 1
    resumed = runs.run_job(job, resume_dir=tmp_path)
    for key in ("val_loss", "fixed_val_loss", "consensus_val_loss", "loss_curve", "outer_rounds",
                "weight_std"):
        assert resumed[key] == unbroken[key], key
    assert resumed["cpu_s"] > 0 and not list(tmp_path.glob("*.pkl"))  # done: nothing left to go on from


def test_another_job_never_goes_on_from_a_run_it_is_not(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "RESUME_EVERY_S", 0.0)
    job = Job("size", 2, 2, "noloco", 0, PLAN)
    with monkeypatch.context() as patch:
        _stop_after(4, patch)
        with pytest.raises(Stopped):
            runs.run_job(job, resume_dir=tmp_path)
    other = Job("size", 2, 2, "noloco", 1, PLAN)  # another seed
    with_folder, without = runs.run_job(other, resume_dir=tmp_path), runs.run_job(other)
    assert {k: v for k, v in with_folder.items() if k not in ("wall_s", "cpu_s")} == {
        k: v for k, v in without.items() if k not in ("wall_s", "cpu_s")}
    assert len(list(tmp_path.glob("*.pkl"))) == 1  # the stopped one's is still there, for its own job

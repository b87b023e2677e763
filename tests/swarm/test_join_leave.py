"""Late join with a state download, and a graceful leave, with real node processes."""

import signal

from swarm_node.data.spec import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec


def spec(run_id: str, steps: int) -> RunSpec:
    return RunSpec(run_id=run_id, model_size="debug", num_stages=2, seq_len=32, batch_size=8,
                   samples_per_step=8,
                   total_steps=steps, data=DataSpec(kind="synthetic", order=1, num_tokens=400_000),
                   method=default_method("noloco", inner_steps=20),
                   inner=InnerHyper(lr=3e-3, warmup_steps=10, total_steps=steps))


def test_late_joiner_downloads_the_donors_state_then_takes_part(harness_factory):
    h = harness_factory(spec("late-join", 1000))
    driver = h.spawn(0, "--round-timeout", "5", name="driver")
    donor = h.spawn(1, "--round-timeout", "5", name="donor")
    donor_id = h.wait_for(lambda: next((p for p, r in h.records(1).items() if r.inner_step >= 30), None), 90,
                          "the donor to train")
    joiner = h.spawn(1, "--round-timeout", "5", name="joiner")

    def joiner_record():
        return [r for p, r in h.records(1).items() if p != donor_id and r.state == "training"]

    first = h.wait_for(joiner_record, 90, "the joiner to start training")[0]
    h.wait_for(lambda: any(r.outer_round >= first.outer_round + 2 for r in joiner_record()), 90,
               "the joiner to take part in two more rounds")
    for proc in (driver, donor, joiner):
        proc.send_signal(signal.SIGTERM)
    for proc in (driver, donor, joiner):
        assert proc.wait(timeout=30) == 0
    donor_summary, joiner_summary = h.summary_of(donor), h.summary_of(joiner)
    assert joiner_summary["downloaded_from"] == donor_summary["peer_id"]
    # The digest covers theta, phi and momentum and is checked on arrival: the joiner
    # loaded exactly the snapshot the donor served at download time.
    assert joiner_summary["downloaded_digest"] in donor_summary["served_digests"]
    assert first.inner_step >= 30  # it continued from the donor's counters, not from zero
    assert joiner_summary["rounds_with_partner"] >= 1, h.log_of("joiner")[-2000:]
    assert donor_summary["peer_id"] == donor_id and donor_id in joiner_summary["partners"]


def test_a_peer_leaving_gracefully_does_not_stall_the_others(harness_factory):
    h = harness_factory(spec("leave", 120))
    driver = h.spawn(0, "--max-steps", "120", "--round-timeout", "5", name="driver")
    stay = h.spawn(1, "--round-timeout", "5", name="stay")
    leave = h.spawn(1, "--round-timeout", "5", name="leave")
    h.wait_for(lambda: any(r.inner_step >= 30 for r in h.records(0).values()), 90, "training to start")
    leave.send_signal(signal.SIGTERM)
    assert leave.wait(timeout=30) == 0
    h.wait_for(lambda: driver.poll() is not None, 120, "the stage-0 node to finish without the leaver")
    assert driver.returncode == 0
    stay.send_signal(signal.SIGTERM)
    assert stay.wait(timeout=30) == 0
    driver_summary = h.summary_of(driver)
    assert driver_summary["inner_steps"] == 120
    assert driver_summary["microbatches_lost"] <= 4  # at most what was in flight to the leaver
    assert h.summary_of(leave)["status"] == "finished"  # it shut down cleanly and wrote its summary


def test_every_stage_given_max_steps_finishes_on_its_own(harness_factory):
    """As a volunteer types it: the same --max-steps on both stages. A later stage's steps
    lag stage 0's by the micro-batches in flight, so it may never reach the number; it
    finishes once stage 0 has ended instead of waiting for work forever."""
    h = harness_factory(spec("both-stop", 60))
    first = h.spawn(0, "--max-steps", "60", "--round-timeout", "5", name="first")
    second = h.spawn(1, "--max-steps", "60", "--round-timeout", "5", name="second")
    h.wait_for(lambda: first.poll() is not None and second.poll() is not None, 120, "both stages to finish")
    assert (first.returncode, second.returncode) == (0, 0)
    summaries = [h.summary_of(p) for p in (first, second)]
    assert summaries[0]["inner_steps"] == 60 and 50 <= summaries[1]["inner_steps"] <= 60, summaries
    assert all(s["status"] == "finished" for s in summaries)

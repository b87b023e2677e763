"""Late join with a state download, and a graceful leave, with real node processes."""

import signal

from swarm_node.data.spec import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec


def spec(run_id: str, steps: int) -> RunSpec:
    return RunSpec(run_id=run_id, model_size="debug", num_stages=2, seq_len=32, batch_size=8, samples_per_step=8,
                   total_steps=steps, data=DataSpec(kind="synthetic", order=1, num_tokens=400_000),
                   method=default_method("noloco", inner_steps=20),
                   inner=InnerHyper(lr=3e-3, warmup_steps=10, total_steps=steps))


def test_late_joiner_downloads_the_donors_state_then_takes_part(harness_factory):
    h = harness_factory(spec("late-join", 160))
    driver = h.spawn(0, "--max-steps", "160", "--round-timeout", "5", name="driver")
    donor = h.spawn(1, "--round-timeout", "5", name="donor")
    h.wait_for(lambda: any(r.inner_step >= 30 for r in h.records(1).values()), 90, "the donor to train")
    joiner = h.spawn(1, "--round-timeout", "5", name="joiner")
    h.wait_for(lambda: driver.poll() is not None, 150, "the stage-0 node to finish")
    assert driver.returncode == 0, h.log_of("driver")[-2000:]
    for proc in (donor, joiner):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    donor_summary, joiner_summary = h.summary_of(donor), h.summary_of(joiner)
    assert joiner_summary["downloaded_from"] == donor_summary["peer_id"]
    # The digest covers theta, phi and momentum and is checked on arrival: the joiner
    # loaded exactly the snapshot the donor served at download time.
    assert joiner_summary["downloaded_digest"] in donor_summary["served_digests"]
    assert joiner_summary["rounds_with_partner"] >= 1, h.log_of("joiner")[-2000:]
    assert joiner_summary["inner_steps"] > 30


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

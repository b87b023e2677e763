"""A shifter among real node processes: a stage-0 peer that adds 5x its own Delta norm,
spread over every element, to the phi and Delta it sends, its own outer step honest
(tests/swarm/shifter.py), beside the three honest stage-0 peers of a 2 x 3 debug swarm,
from the first step to the end of the learning-rate schedule. It is averaged with at
most twice a run (all honest peers together), and the honest peers never refuse each
other. The screen's rule is gossip/partner_check.py's; the cases that let a shifter in
are reproduced in process in tests/unit/test_partner_check.py and
tests/inproc/test_poisoned_updates.py. Ten runs: that it holds run after run is the point."""

import json
import signal
from pathlib import Path

import pytest

from swarm_node.config import default_warmup_steps
from swarm_node.data.spec import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec

SHIFTER = (str(Path(__file__).with_name("shifter.py")),)
STEPS = 1000  # the schedule (warm-up, then cosine): the honest stage-0 peers stop at its end
REPLICAS = 3
COMMON = ("--round-timeout", "15", "--no-state-download", "--wait-for-peers", str(REPLICAS))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def spec() -> RunSpec:
    """`swarm-node local --stages 2 --replicas 3 --model debug --data synthetic --inner-steps 25
    --steps 1000`'s."""
    return RunSpec(run_id="shifter", model_size="debug", num_stages=2, seq_len=64, batch_size=8,
                   samples_per_step=8, total_steps=STEPS, data=DataSpec.parse("synthetic"),
                   method=default_method("noloco", inner_steps=25),
                   inner=InnerHyper(lr=3e-3, warmup_steps=default_warmup_steps(STEPS), total_steps=STEPS))


def last_train_loss(path: Path) -> float | None:
    losses = [json.loads(line).get("train_loss") for line in path.read_text().splitlines() if line.strip()]
    return next((loss for loss in reversed(losses) if loss is not None), None)


@pytest.mark.parametrize("run", range(10))
def test_a_shifter_is_averaged_with_at_most_twice_and_the_honest_peers_keep_pairing(harness_factory, run):
    h = harness_factory(spec())
    shards = REPLICAS + 1
    honest0 = [h.spawn(0, *COMMON, "--max-steps", str(STEPS), "--data-shard", f"{r}/{shards}", name=f"s0r{r}")
               for r in range(REPLICAS)]
    honest1 = [h.spawn(1, *COMMON, name=f"s1r{r}") for r in range(REPLICAS)]
    shifter = h.spawn(0, *COMMON, "--max-steps", str(STEPS), "--data-shard", f"{REPLICAS}/{shards}",
                      name="shifter", program=SHIFTER, env={"SHIFT_SCALE": "5"})
    h.wait_for(lambda: all(p.poll() is not None for p in honest0), 540, "the honest stage-0 peers to finish")
    for proc in (*honest1, shifter):
        proc.send_signal(signal.SIGTERM)
    assert [p.wait(timeout=60) for p in (*honest0, *honest1, shifter)] == [0] * (2 * REPLICAS + 1)
    shifter_id = h.summary_of(shifter)["peer_id"][-6:]
    summaries = {f"s{s}r{r}": h.summary_of(p) for s, procs in enumerate((honest0, honest1))
                 for r, p in enumerate(procs)}
    honest_ids = {s["peer_id"][-6:] for s in summaries.values()}
    averaged = {name: [p[-6:] for p in s["partners"]].count(shifter_id)
                for name, s in summaries.items() if name.startswith("s0")}
    turned_away, honest_refused = 0, []
    for name in summaries:
        lines = h.log_of(name).splitlines()
        turned_away += sum(f"peer {shifter_id}: rejected its update" in line
                           or f"with {shifter_id} at" in line for line in lines)
        honest_refused += [line for line in lines
                           if "rejected its update" in line and any(f"peer {i}:" in line for i in honest_ids)]
    losses = [last_train_loss(path) for path in sorted(h.tmp_path.glob("metrics-stage1-*.jsonl"))]
    print(f"run {run}: averaged with the shifter {averaged}, turned away {turned_away} times, "
          f"stage-1 train loss {losses}")
    assert sum(averaged.values()) <= 2, averaged
    assert not honest_refused, honest_refused
    assert turned_away >= 1  # it was met, and turned away
    for name, s in summaries.items():  # the honest peers keep pairing with each other
        with_honest = sum(p[-6:] != shifter_id for p in s["partners"])
        assert with_honest >= s["outer_rounds"] / 2, (name, s["partners"], s["outer_rounds"])

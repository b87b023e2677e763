"""Honest joins are never refused (state/check.py): 30 volunteers join 2 x 2 runs of
three seeds on the bundled corpus, one after another, stages alternating, at most two
joiners alive at once, so they join stages of 2, 3 and 4 peers. Every one adopts a
checked state (0 refusals), and asking the witnesses and weighing their votes takes
under 10 % of the join. Slow: about 10 minutes."""

from __future__ import annotations

import re
import signal
import time

import pytest

from swarm_node.data.spec import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

SEEDS = (0, 1, 2)
JOINS_PER_SEED = 10
ALIVE_JOINERS = 2


def spec(seed: int) -> RunSpec:
    return RunSpec(run_id=f"honest-joins-{seed}", model_size="debug", num_stages=2, seq_len=32, batch_size=8,
                   samples_per_step=8, total_steps=5000, seed=seed, data=DataSpec(kind="corpus"),
                   method=default_method("noloco", inner_steps=10), inner=InnerHyper(lr=3e-3, warmup_steps=50,
                                                                                        total_steps=5000))


def test_thirty_honest_joins_are_all_adopted_and_the_check_is_cheap(harness_factory):
    figures = []
    for seed in SEEDS:
        h = harness_factory(spec(seed))
        for stage in (0, 0, 1, 1):
            h.spawn(stage, "--round-timeout", "5", name=f"s{seed}-base{stage}-{len(h.processes)}")
        h.wait_for(lambda h=h: all(r.outer_round >= 3 for s in (0, 1) for r in h.records(s).values())
                   and all(len(h.records(s)) == 2 for s in (0, 1)), 240, "the 2 x 2 run to train 3 rounds")
        alive = []
        for k in range(JOINS_PER_SEED):
            stage = k % 2
            size = sum(r.state == "training" for r in h.records(stage).values())
            started = time.monotonic()
            name = f"s{seed}-join{k}"
            proc = h.spawn(stage, "--round-timeout", "5", name=name)
            h.wait_for(lambda h=h, name=name, stage=stage: "downloaded state from" in h.log_of(name)
                       and training(h, name, stage), 180,
                       f"joiner {name} to adopt a state and train")
            join_s = time.monotonic() - started
            alive.append((proc, name, stage, size, join_s))
            while len(alive) > ALIVE_JOINERS:
                figures.append(finish(h, *alive.pop(0)))
        figures.extend(finish(h, *entry) for entry in alive)
        h.close()
    for f in figures:
        print(f)
    assert len(figures) == len(SEEDS) * JOINS_PER_SEED
    assert sum(f["refused"] for f in figures) == 0, figures
    assert all("agree" in f["verdict"] for f in figures), figures
    assert {f["stage_size"] for f in figures} >= {2, 3}
    assert max(f["check_s"] / f["join_s"] for f in figures) < 0.10, figures


def training(h, name: str, stage: int) -> bool:
    """The joiner's record says it trains (logs name a peer by the tail of its id)."""
    found = re.search(r"node (\w+): stage \d+ of", h.log_of(name))
    return bool(found) and any(p.endswith(found.group(1)) and r.state == "training" and r.inner_step > 0
                               for p, r in h.records(stage).items())


def finish(h, proc, name: str, stage: int, size: int, join_s: float) -> dict:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, h.log_of(name)[-2000:]
    summary = h.summary_of(proc)
    return {"joiner": name, "stage": stage, "stage_size": size, "join_s": round(join_s, 1),
            "check_s": round(summary["state_check_s"], 3),
            "download_s": round(summary["state_download_s"], 3), "refused": summary["states_refused"],
            "verdict": summary["state_check"]}

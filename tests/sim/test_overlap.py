"""The overlapped outer round (ALGORITHM.md section 3.1) against the blocking one at
equal tokens: the exchange lands half a round, one round or two rounds' worth of inner
steps after the boundary (two rounds: the node waits at the next boundary, which costs
time, not steps)."""

import dataclasses
import statistics

import pytest
import torch

from swarm_node.data import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.sim import SimConfig, Simulator

STEPS, H = 300, 10
CONFIG = SimConfig(method=default_method("noloco", inner_steps=H),
                   inner=InnerHyper(lr=3e-3, warmup_steps=10, total_steps=STEPS),
                   data=DataSpec(kind="synthetic", order=1, num_tokens=200_000), replicas=4, stages=2,
                   seq_len=32,
                   batch_size=8, steps=STEPS, eval_every_steps=STEPS, eval_batches=4)


def final_loss(latency_steps: int | None, seed: int = 0) -> float:
    torch.manual_seed(seed)
    result = Simulator(dataclasses.replace(CONFIG, outer_latency_steps=latency_steps, seed=seed)).run()
    assert result.outer_rounds == STEPS // H
    return result.final_val_loss


# two 4 x 2 runs; the rule's steps are checked by default in tests/unit/test_overlapped_worker.py
@pytest.mark.slow
def test_an_exchange_landing_half_a_round_late_trains_as_well_as_the_blocking_round():
    blocking, overlapped = final_loss(None), final_loss(H // 2)
    assert overlapped != blocking  # the rule ran: the progress made meanwhile was carried
    assert abs(overlapped - blocking) <= 0.01 * blocking, (overlapped, blocking)


@pytest.mark.slow
@pytest.mark.parametrize("latency_steps", [H // 2, H, 2 * H], ids=["half a round", "one round", "two rounds"])
def test_overlapped_rounds_within_1_percent_of_blocking_over_3_seeds(latency_steps):
    blocking = [final_loss(None, seed) for seed in range(3)]
    overlapped = [final_loss(latency_steps, seed) for seed in range(3)]
    gaps = [o / b - 1 for o, b in zip(overlapped, blocking)]
    print(f"latency {latency_steps} steps: blocking {statistics.mean(blocking):.4f}, overlapped "
          f"{statistics.mean(overlapped):.4f}, gap per seed {[f'{g:+.2%}' for g in gaps]}")
    assert abs(statistics.mean(overlapped) / statistics.mean(blocking) - 1) <= 0.01

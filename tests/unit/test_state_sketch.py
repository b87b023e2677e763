"""Count sketches of a stage's state (state/sketch.py): linear, an unbiased estimate of
squared norms, every element counts, and phi a round earlier from phi and momentum."""

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_node.state.sketch import SKETCH_BUCKETS, count_sketch, sketch_rows, sketch_state


def test_the_sketch_of_a_difference_is_the_difference_of_the_sketches(gen):
    a, b = torch.randn(300, 70, generator=gen), torch.randn(300, 70, generator=gen)
    assert torch.allclose(count_sketch(a, 7, 3) - count_sketch(b, 7, 3), count_sketch(a - b, 7, 3), atol=1e-4)


def test_the_squared_norm_of_a_sketch_estimates_the_tensors_without_bias(gen):
    v = torch.randn(5000, generator=gen)
    estimates = [float(count_sketch(v, seed, 0).pow(2).sum()) for seed in range(400)]
    truth = float(v.pow(2).sum())
    assert statistics.mean(estimates) == pytest.approx(truth, rel=0.03)
    # the relative spread of one estimate is about sqrt(2 / buckets)
    assert statistics.stdev(estimates) / truth == pytest.approx((2 / SKETCH_BUCKETS) ** 0.5, rel=0.25)


def test_small_tensors_are_kept_whole():
    t = torch.arange(10, dtype=torch.float32)
    assert torch.equal(count_sketch(t, 1, 0)[:10], t) and not count_sketch(t, 1, 0)[10:].any()


def test_seeds_and_positions_key_the_sketch(gen):
    t = torch.randn(1000, generator=gen)
    assert torch.equal(count_sketch(t, 5, 0), count_sketch(t, 5, 0))
    assert not torch.equal(count_sketch(t, 5, 0), count_sketch(t, 6, 0))
    assert not torch.equal(count_sketch(t, 5, 0), count_sketch(t, 5, 1))


@settings(max_examples=60, deadline=None)
@given(index=st.integers(0, 9_999), seed=st.integers(0, (1 << 62) - 1), change=st.floats(1e-3, 1e3))
def test_every_element_counts(index, seed, change):
    """No blind spots: a change to any one element moves its bucket by exactly that much."""
    base = torch.zeros(10_000)
    moved = base.clone()
    moved[index] = change
    difference = count_sketch(moved, seed, 2) - count_sketch(base, seed, 2)
    assert float(difference.abs().sum()) == pytest.approx(change, rel=1e-5)


def test_chunks_do_not_change_the_sketch(gen, monkeypatch):
    from swarm_node.state import sketch

    t = torch.randn(5000, generator=gen)
    whole = count_sketch(t, 11, 4)
    monkeypatch.setattr(sketch, "_CHUNK", 333)
    assert torch.allclose(count_sketch(t, 11, 4), whole, atol=1e-5)


def test_phi_a_round_earlier_is_phi_minus_the_momentum(gen):
    before = [torch.randn(40, 30, generator=gen), torch.randn(17, generator=gen)]
    momentum = [torch.randn(40, 30, generator=gen) * 0.01, torch.randn(17, generator=gen) * 0.01]
    phi = [b + m for b, m in zip(before, momentum)]
    theta = [p + 0.001 for p in phi]
    sketch = sketch_state(theta, phi, momentum, inner_step=12, outer_round=3, round_steps=2, seed=99)
    assert torch.allclose(sketch.phi_before, sketch_rows(before, 99), atol=1e-5)
    assert torch.allclose(sketch.phi, sketch_rows(phi, 99), atol=1e-6)
    assert torch.allclose(sketch.progress, sketch_rows([t - p for t, p in zip(theta, phi)], 99), atol=1e-6)
    assert sketch.rows().shape == (3, 2, SKETCH_BUCKETS)


def test_the_sketch_is_what_protocol_md_says(gen):
    """docs/PROTOCOL.md 4.4.1, written out in plain Python, for another implementation."""
    mask, prime = (1 << 64) - 1, (1 << 31) - 1

    def keys(seed, k):
        s = (seed * 0x9E3779B97F4A7C15 + k * 0xBF58476D1CE4E5B9) & mask
        out = []
        for _ in range(2):
            s = (s + 0x9E3779B97F4A7C15) & mask
            z = s
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
            out.append(1 + (z ^ (z >> 31)) % (prime - 1))
        return out

    values = torch.randn(300, generator=gen)
    seed, k = 987654321987, 5
    a, b = keys(seed, k)
    buckets = [0.0] * SKETCH_BUCKETS
    for i, x in enumerate(values.tolist()):
        h = (a * i + b) % prime
        buckets[h % SKETCH_BUCKETS] += (1 if (h >> 6) % 2 else -1) * x
    assert torch.allclose(count_sketch(values, seed, k), torch.tensor(buckets), atol=1e-4)

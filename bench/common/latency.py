"""The NoLoCo paper's section 5.3 latency model as vectorised Monte Carlo (numpy only),
shared by bench.latency_model and the convergence benchmark's wall-clock table.

Communication: the critical path of a binary-tree all-reduce among N peers against
that of one pair exchange, with log-normal message times. Idle time: the wall time of
a run under DiLoCo's global barrier against NoLoCo's pairwise waits, with log-normal
inner-step times. Every function takes its own ``numpy.random.Generator`` so results
are reproducible and the callers decide the sample counts."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# One Monte Carlo array holds at most this many elements (8 MiB of float32); larger draws go in chunks.
CHUNK_ELEMENTS = 1 << 21

PathSampler = Callable[[np.random.Generator, int, float, int], np.ndarray]


def lognormal_params(mean: float, cv: float) -> tuple[float, float]:
    """(mu, sigma) of the log-normal whose mean is ``mean`` and std/mean is ``cv``."""
    sigma2 = math.log1p(cv * cv)
    return math.log(mean) - sigma2 / 2, math.sqrt(sigma2)


def lognormal(rng: np.random.Generator, mu: float, sigma: float, shape) -> np.ndarray:
    """LogNormal(mu, sigma^2) draws in float32: twice as fast as ``rng.lognormal``, and precise
    enough for means of sums of a few hundred draws. sigma = 0 gives exactly exp(mu) everywhere."""
    draws = rng.standard_normal(shape, dtype=np.float32)
    draws *= sigma
    draws += mu
    return np.exp(draws, out=draws)


def message_times(rng: np.random.Generator, shape, cv: float, mean: float = 1.0) -> np.ndarray:
    return lognormal(rng, *lognormal_params(mean, cv), shape)


def _levels(n_peers: int) -> int:
    levels = int(math.log2(n_peers))
    if n_peers < 2 or 2 ** levels != n_peers:
        raise ValueError(f"the tree model needs a power of two >= 2 peers, got {n_peers}")
    return levels


def tree_paths(rng: np.random.Generator, n_peers: int, cv: float, samples: int) -> np.ndarray:
    """Critical path of a binary-tree all-reduce (the model used for the headline), one per sample.

    Reduce: the peers are the leaves; a merge point forwards its partial sum once both of
    its two incoming messages have arrived, so each level costs the slower of two messages
    on every branch and the slowest branch sets when the root has the sum. Broadcast
    mirrors it: done when the last leaf has the result. With equal message times t this is
    exactly 2 * log2(N) * t, and N = 2 is one pair exchange (2 t)."""
    levels = _levels(n_peers)
    ready = np.zeros((samples, n_peers), dtype=np.float32)
    for _ in range(levels):
        arrived = ready + message_times(rng, ready.shape, cv)
        ready = arrived.reshape(samples, -1, 2).max(axis=2)
    reached = np.zeros((samples, 1), dtype=np.float32)
    for _ in range(levels):
        reached = np.repeat(reached, 2, axis=1)
        reached += message_times(rng, reached.shape, cv)
    return ready[:, 0] + reached.max(axis=1)


def binomial_tree_paths(rng: np.random.Generator, n_peers: int, cv: float, samples: int) -> np.ndarray:
    """Variant: a peer is its own child, so each merge waits for one message (its partner subtree's)."""
    levels = _levels(n_peers)
    ready = np.zeros((samples, n_peers), dtype=np.float32)
    for _ in range(levels):
        pairs = ready.reshape(samples, -1, 2)
        ready = np.maximum(pairs[:, :, 0], pairs[:, :, 1] + message_times(rng, pairs.shape[:2], cv))
    reached = np.zeros((samples, 1), dtype=np.float32)
    for _ in range(levels):
        reached = np.stack([reached, reached + message_times(rng, reached.shape, cv)],
                           axis=2).reshape(samples, -1)
    return ready[:, 0] + reached.max(axis=1)


def level_barrier_paths(rng: np.random.Generator, n_peers: int, cv: float, samples: int) -> np.ndarray:
    """Variant: the same tree, but every level waits for the slowest message of the whole level."""
    widths = [n_peers >> level for level in range(_levels(n_peers))]  # N, N/2, ..., 2 messages
    total = np.zeros(samples, dtype=np.float32)
    for width in widths + widths[::-1]:
        total += message_times(rng, (samples, width), cv).max(axis=1)
    return total


def slowest_pair_paths(rng: np.random.Generator, n_peers: int, cv: float, samples: int) -> np.ndarray:
    """The slowest of N/2 concurrent pair exchanges: what a pair round would cost behind a global barrier."""
    pairs = n_peers // 2
    return sample_paths(tree_paths, rng, 2, cv, samples * pairs).reshape(samples, pairs).max(axis=1)


def sample_paths(sampler: PathSampler, rng: np.random.Generator, n_peers: int, cv: float,
                 samples: int) -> np.ndarray:
    """``sampler``'s critical paths, drawn in chunks so that big N x samples fit in memory."""
    chunk = max(1, CHUNK_ELEMENTS // n_peers)
    parts = [sampler(rng, n_peers, cv, min(chunk, samples - start)) for start in range(0, samples, chunk)]
    return np.concatenate(parts)


def pair_exchange_mean(cv: float, mean: float = 1.0) -> float:
    """Exact E[one pair exchange] in the tree model (N = 2): two phases, each the slower of two messages.

    For i.i.d. log-normals E[max(X1, X2)] = 2 E[X] Phi(sigma / sqrt 2) = E[X] (1 + erf(sigma / 2)),
    so the denominator of the ratio carries no Monte Carlo noise."""
    _, sigma = lognormal_params(mean, cv)
    return 2 * mean * (1 + math.erf(sigma / 2))


def allreduce_to_pair_ratio(rng: np.random.Generator, n_peers: int, cv: float, samples: int) -> dict:
    """E[all-reduce critical path among N] / E[one pair exchange], both in units of the mean message time.

    The pair is the expected time of ONE exchange between two peers (the N = 2 case of the
    same tree), not the slowest of all pairs: NoLoCo has no global barrier, so a peer only
    ever waits for its own partner."""
    allreduce = sample_paths(tree_paths, rng, n_peers, cv, samples)
    pair = pair_exchange_mean(cv)
    mean = float(allreduce.mean(dtype=np.float64))
    return {"ratio": mean / pair,
            "stderr": float(allreduce.std(dtype=np.float64)) / math.sqrt(samples) / pair,
            "allreduce_t": mean, "pair_t": pair}


def random_pairs(rng: np.random.Generator, replicas: int, n_workers: int) -> tuple[np.ndarray, np.ndarray]:
    """A uniformly random perfect matching of the workers of each replica swarm: (first, second) indices."""
    if n_workers % 2:
        raise ValueError(f"pairing needs an even number of workers, got {n_workers}")
    order = rng.permuted(np.tile(np.arange(n_workers), (replicas, 1)), axis=1)
    return order[:, 0::2], order[:, 1::2]


def pairwise_barrier(rng: np.random.Generator, done: np.ndarray,
                     exchange: np.ndarray | None = None) -> np.ndarray:
    """Clocks after one NoLoCo outer round: both partners continue from the later of their two clocks.

    A slow worker delays its partner, who carries the delay into the next round's pair, so
    a delay spreads through the swarm over rounds instead of stopping everyone at once.
    ``exchange``: optional (replicas, N/2) pair-exchange times added after the wait."""
    first, second = random_pairs(rng, *done.shape)
    later = np.maximum(np.take_along_axis(done, first, axis=1), np.take_along_axis(done, second, axis=1))
    if exchange is not None:
        later = later + exchange
    clocks = np.empty_like(done)
    np.put_along_axis(clocks, first, later, axis=1)
    np.put_along_axis(clocks, second, later, axis=1)
    return clocks


@dataclass(frozen=True)
class Variant:
    """One way to run the swarm: H inner steps per outer round, and optionally communication,
    ``message`` = (mean_s, std/t): a tree all-reduce among N for DiLoCo, one pair exchange for NoLoCo."""
    inner_steps: int
    message: tuple[float, float] | None = None


class _Run:
    """DiLoCo's and NoLoCo's clocks for one variant, fed the shared inner-step times chunk by chunk."""

    def __init__(self, variant: Variant, replicas: int, n_workers: int):
        self.variant = variant
        self.rounds = 0
        self.diloco = np.zeros(replicas)  # all workers restart together after every round
        self.clocks = np.zeros((replicas, n_workers))  # NoLoCo: each worker's own clock
        self.work = np.zeros((replicas, n_workers))  # inner-step time since the last round

    def add(self, rng: np.random.Generator, work: np.ndarray, steps_done: int) -> None:
        self.work += work
        if steps_done % self.variant.inner_steps:
            return
        replicas, n_workers = self.work.shape
        self.diloco += self.work.max(axis=1)
        exchange = None
        if self.variant.message is not None:
            mean_s, cv = self.variant.message
            self.diloco += mean_s * tree_paths(rng, n_workers, cv, replicas)
            exchange = mean_s * tree_paths(rng, 2, cv, replicas * n_workers // 2).reshape(replicas, -1)
        self.clocks = pairwise_barrier(rng, self.clocks + self.work, exchange)
        self.work[:] = 0
        self.rounds += 1

    def result(self) -> dict:
        diloco_s, noloco_s = float(self.diloco.mean()), float(self.clocks.max(axis=1).mean())
        return {"rounds": self.rounds, "diloco_s": diloco_s, "noloco_s": noloco_s,
                "ratio": diloco_s / noloco_s}


def barrier_run_times(rng: np.random.Generator, n_workers: int, variants: list[Variant], step_mu: float,
                      step_sigma: float, total_inner_steps: int, replicas: int) -> list[dict]:
    """Wall time of a run of ``total_inner_steps`` under DiLoCo's and NoLoCo's barriers, per variant.

    Each worker's inner steps take LogNormal(step_mu, step_sigma^2). DiLoCo: every H steps
    all N workers wait for the slowest, then start together. NoLoCo: every H steps each
    worker waits for its random partner only. The run ends when the last worker is done;
    ``replicas`` independent swarms are averaged. Every method and variant sees the same
    step draws (drawn in chunks of gcd(H)), so their ratios carry little noise and the
    draws, the bulk of the cost, are made once."""
    chunk = math.gcd(*(v.inner_steps for v in variants))
    runs = [_Run(v, replicas, n_workers) for v in variants]
    for steps_done in range(chunk, total_inner_steps + 1, chunk):
        work = lognormal(rng, step_mu, step_sigma, (replicas, n_workers, chunk)).sum(axis=2, dtype=np.float64)
        for run in runs:
            run.add(rng, work, steps_done)
    return [run.result() for run in runs]

"""Compact sketches of a stage's state, for checking a downloaded state against other
replicas (docs/ALGORITHM.md section 8). Pure torch, no I/O.

A count sketch folds a tensor into ``buckets`` signed sums: every element lands in one
bucket with a random sign, both drawn from one hash of its index keyed by a seed. It is
linear, so the sketch of a difference is the difference of the sketches, and the squared
norm of a sketch is an unbiased estimate of the tensor's squared norm (relative error
about sqrt(2 / buckets) per tensor, less summed over a stage's tensors). Every element
counts, so a change hidden in elements nobody samples still moves the sketch; and since
the seed is drawn by the checker after the state is in, a donor cannot aim a change at
the sketch's blind spots. Tensors of at most ``buckets`` elements are kept whole.

A state's sketch holds three rows per parameter tensor: phi (the slow weights), the
outer momentum (with heavy-ball momentum, exactly phi's last step: phi_r = phi_(r-1) +
momentum_r, so one sketch also gives phi a round earlier) and theta - phi (the progress
since the last outer step)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

SKETCH_BUCKETS = 64
_PRIME = (1 << 31) - 1  # hash modulus: index * key stays below 2^62
_CHUNK = 1 << 20  # elements hashed at once: bounds the index tensors' memory


def _keys(seed: int, tensor_index: int) -> tuple[int, int]:
    """Two hash keys in [1, 2^31 - 1) for one tensor, from a splitmix64 of the seed."""
    state = (seed * 0x9E3779B97F4A7C15 + tensor_index * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    keys = []
    for _ in range(2):
        state = (state + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
        keys.append(1 + (z ^ (z >> 31)) % (_PRIME - 1))
    return keys[0], keys[1]


def count_sketches(tensors: Sequence[torch.Tensor], seed: int, tensor_index: int,
                   buckets: int = SKETCH_BUCKETS) -> list[torch.Tensor]:
    """Tensors of one shape (a parameter's phi, momentum, ...) each folded into
    ``buckets`` float32 sums under the same hash (kept whole, zero-padded, when that
    small), on the CPU. Element i's hash h = (a * i + b) mod (2^31 - 1) gives its bucket
    (h mod buckets, a power of two) and its sign (the next bit of h): one hash serves
    every tensor and both choices."""
    flats = [t.detach().reshape(-1) for t in tensors]
    numel, device = flats[0].numel(), flats[0].device
    outs = [torch.zeros(buckets, dtype=torch.float32, device=device) for _ in flats]
    if numel <= buckets:
        for out, flat in zip(outs, flats):
            out[:numel] = flat.float()
        return [out.cpu() for out in outs]
    a, b = _keys(seed, tensor_index)
    # 2 x buckets signed bins: bin h mod 2*buckets is bucket h mod buckets, on the + side
    # when the next bit of h is 1; one scatter a tensor and no sign to multiply by
    bins = [torch.zeros(2 * buckets, dtype=torch.float32, device=device) for _ in flats]
    offsets = torch.arange(min(_CHUNK, numel), dtype=torch.int64, device=device)
    for start in range(0, numel, _CHUNK):
        index = offsets[:min(_CHUNK, numel - start)] + start
        bin_of = (index * a + b) % _PRIME & (2 * buckets - 1)
        for signed, flat in zip(bins, flats):
            signed.index_add_(0, bin_of, flat[start:start + _CHUNK].float())
    for out, signed in zip(outs, bins):
        out.copy_(signed[buckets:] - signed[:buckets])
    return [out.cpu() for out in outs]


def count_sketch(tensor: torch.Tensor, seed: int, tensor_index: int,
                 buckets: int = SKETCH_BUCKETS) -> torch.Tensor:
    """One tensor folded into ``buckets`` float32 sums (count_sketches)."""
    return count_sketches([tensor], seed, tensor_index, buckets)[0]


def sketch_rows(tensors: Iterable[torch.Tensor], seed: int, buckets: int = SKETCH_BUCKETS) -> torch.Tensor:
    """(tensors, buckets): one count sketch per tensor, keyed by its position."""
    rows = [count_sketch(t, seed, i, buckets) for i, t in enumerate(tensors)]
    return torch.stack(rows) if rows else torch.zeros(0, buckets)


@dataclass(frozen=True)
class StateSketch:
    """What a replica says about its state: its counters and (tensors, buckets) sketches
    of phi, the outer momentum and theta - phi, all under one seed."""
    inner_step: int
    outer_round: int
    round_steps: int  # inner steps since the last outer step
    phi: torch.Tensor
    momentum: torch.Tensor
    progress: torch.Tensor

    @property
    def phi_before(self) -> torch.Tensor:
        """phi's sketch before its last outer step (exact for heavy-ball momentum)."""
        return self.phi - self.momentum

    def rows(self) -> torch.Tensor:
        """(3, tensors, buckets): how a sketch travels."""
        return torch.stack([self.phi, self.momentum, self.progress])


def sketch_state(theta: Sequence[torch.Tensor], phi: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                 *, inner_step: int, outer_round: int, round_steps: int, seed: int,
                 buckets: int = SKETCH_BUCKETS) -> StateSketch:
    """The sketch of a state given as its three tensor lists (one tensor a parameter);
    theta - phi is formed one parameter at a time, never for the whole stage."""
    if not len(theta) == len(phi) == len(momentum):
        raise ValueError("theta, phi and momentum must list the same parameters")
    rows: list[list[torch.Tensor]] = [[], [], []]
    for k, (t, p, m) in enumerate(zip(theta, phi, momentum)):
        p = p.to(t.device, torch.float32)
        for row, sketch in zip(rows, count_sketches([p, m.to(t.device), t.detach().float() - p], seed, k,
                                                    buckets)):
            row.append(sketch)
    phi_rows, momentum_rows, progress_rows = (torch.stack(r) if r else torch.zeros(0, buckets) for r in rows)
    return StateSketch(inner_step=inner_step, outer_round=outer_round, round_steps=round_steps,
                       phi=phi_rows, momentum=momentum_rows, progress=progress_rows)

"""What a volunteer's link needs so that the network never holds its GPU up: docs/VOLUNTEERS.md's
tables come from here (``python -m swarm_node.model.links``).

- The outer round: every H inner steps a node swaps (phi, Delta) of its stage with one
  partner, both payloads at once (one on each uplink), beside the next H inner steps.
  The GPU keeps computing while the payload moves within that time:
  ``bytes a parameter x 8 x stage parameters / seconds of H inner steps``, each way.
- Stages: every micro-batch's activations go forward and their gradients come back,
  ``batch x sequence x hidden x bytes a value`` each way per micro-batch at each stage
  boundary, at the rate the stages compute micro-batches."""

from __future__ import annotations

from collections.abc import Sequence

from swarm_node.model.config import NAMED_SIZES, ModelConfig, model_config
from swarm_node.model.memory import per_stage_count, stage_parameters
from swarm_node.wire.boundary import boundary_codec, bytes_per_token
from swarm_node.wire.outer_codec import outer_codec

ACTIVATION_BYTES = {"fp16": 2.0, "int8": 1.0 + 4 / 256}  # a value, blockwise steps included


def round_mbit(parameters: int, inner_phase_s: float, codec: str = "near4-3") -> float:
    """Mbit/s each way for a stage of ``parameters`` whose outer payload must move within
    ``inner_phase_s`` (the H inner steps it runs beside)."""
    return outer_codec(codec).bytes_per_parameter() * 8 * parameters / inner_phase_s / 1e6


def activation_mbit(hidden_size: int, tokens_per_microbatch: int, microbatches_per_s: float,
                    codec: str = "int8") -> float:
    """Mbit/s each way across one stage boundary (activations forward, gradients back)."""
    return ACTIVATION_BYTES[codec] * hidden_size * tokens_per_microbatch * 8 * microbatches_per_s / 1e6


def coded_mbit(hidden_size: int, vocab_size: int, batch: int, seq: int, microbatches_per_s: float,
               codec: str = "bottleneck8", ratio: float = 32.0) -> float:
    """Mbit/s each way across one coded stage boundary (wire/boundary.py): the code, its
    steps, the window's token ids and the frame, the larger of the two directions."""
    coded = boundary_codec(codec, hidden_size=hidden_size, ratio=ratio, vocab_size=vocab_size, batch=batch,
                           seq=seq)
    return max(bytes_per_token(coded, batch, seq)) * batch * seq * 8 * microbatches_per_s / 1e6


def _rate(mbit: float) -> str:
    return f"{mbit / 1000:.1f} Gbit/s" if mbit >= 1000 else f"{mbit:.2g} Mbit/s" if mbit < 10 else \
        f"{mbit:.0f} Mbit/s"


TEST_SIZES = ("debug", "mini")  # sized for tests and CPU benchmarks, not for a run over links


def round_table(*, inner_phase_s: float = 60.0, vocab_size: int = 32_000, seq_len: int = 1024,
                stage_counts: Sequence[int] = (1, 2, 4)) -> str:
    """Per named size and stage count: what the largest stage's round needs each way
    with ``inner_phase_s`` of inner steps between rounds, in the default codec."""
    header = (
        "| model | "
        + " | ".join("one stage" if s == 1 else f"each of {s} stages" for s in stage_counts)
        + " |"
    )
    lines = [header, "|" + "---|" * (1 + len(stage_counts))]
    for size in NAMED_SIZES:
        if size in TEST_SIZES:
            continue
        config = model_config(size, vocab_size=vocab_size, max_seq_len=seq_len)

        def rate(stages: int, config: ModelConfig = config) -> str:
            largest = max(stage_parameters(config, num_stages=stages, stage_index=s) for s in range(stages))
            return _rate(round_mbit(largest, inner_phase_s))

        cells = per_stage_count(config, stage_counts, rate)
        lines.append(f"| {size} ({config.num_parameters() / 1e6:,.1f}M) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def activation_table(*, batch: int = 8, seq_len: int = 1024, microbatches_per_s: float = 1.0,
                     vocab_size: int = 32_000, ratio: float = 32.0) -> str:
    """Per named size: what one stage boundary needs each way at one micro-batch of
    ``batch`` x ``seq_len`` tokens a second, in fp16, int8 and the coded boundary at
    ``ratio`` (its token ids at ``vocab_size``'s width)."""
    lines = ["| model | hidden | fp16 activations | int8 activations "
             f"| bottleneck8 at {ratio:g}x (code and token ids) |", "|---|---|---|---|---|"]
    for size, (hidden, *_) in NAMED_SIZES.items():
        if size in TEST_SIZES:
            continue
        cells = [_rate(activation_mbit(hidden, batch * seq_len, microbatches_per_s, codec))
                 for codec in ("fp16", "int8")]
        cells.append(_rate(coded_mbit(hidden, vocab_size, batch, seq_len, microbatches_per_s, ratio=ratio)))
        lines.append(f"| {size} | {hidden} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(round_table())
    print()
    print(activation_table())

"""What a volunteer's link needs so that the network never holds its GPU up: docs/VOLUNTEERS.md's
tables come from here (``python -m swarm_node.model.links``).

- The outer round: every H inner steps a node swaps (phi, Delta) of its stage with one
  partner, both payloads at once (one on each uplink), beside the next H inner steps.
  The GPU keeps computing while the payload moves within that time:
  ``bytes a parameter x 8 x stage parameters / seconds of H inner steps``, each way.
- Stages: every micro-batch's activations go forward and their gradients come back,
  ``batch x sequence x hidden x bytes a value`` each way per micro-batch at each stage
  boundary, at the rate the stages compute micro-batches.
- A volunteer's uplink (``uplink_table``): both at once, the activations and targets it
  forwards, the gradients it returns and its round, at the rate a stated card computes
  micro-batches (``H200_EAGER_TOKENS_PER_S`` x ``CARD_SHARE``)."""

from __future__ import annotations

from collections.abc import Sequence

from swarm_node.model.config import NAMED_SIZES, ModelConfig, model_config
from swarm_node.model.memory import layer_parameters, per_stage_count, stage_parameters
from swarm_node.model.stages import split_layers
from swarm_node.wire.boundary import BoundaryCodec, boundary_codec, bytes_per_token
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

# -- a volunteer's uplink ------------------------------------------------------------------
# The card the uplink figures assume (issue 55's): a sixth of the model FLOPs a second an
# H200 reached eager in bench/results/gpu_step.json (its "baseline" rows: micro-batches of
# 8 x 1024 tokens, a byte vocabulary, 2 stages, each stage timed alone). Per size, the
# tokens a second of (stage 0, stage 1) there. A stage that is not the last recomputes
# its forward for the backward, which the FLOP count leaves out, so it reaches fewer FLOPs
# a second: a stage is taken at the rate of its kind (not last, last) over its own FLOPs
# a token (a 32k vocabulary's head on the last stage). large was not measured: medium's rates.
H200_EAGER_TOKENS_PER_S = {"tiny": (632_368, 766_198), "small": (226_166, 306_294),
                           "medium": (59_050, 74_367)}
MEASURED_VOCAB, MEASURED_SEQ = 256, 1024
CARD_SHARE = 1 / 6  # a consumer card against the H200
TARGET_BYTES = 4  # fp16 and int8 send the targets as int32 beside the activations
HOME_UPLINKS_MBIT = (10, 20, 50)


def stage_flops_per_token(config: ModelConfig, *, num_stages: int, stage_index: int, seq_len: int) -> int:
    """Model FLOPs a token of one stage's training step: 6 x its matmul parameters (the
    LM head counted, the embedding and anchor lookups and the norms not, a bottleneck's
    encoder and decoder counted) + 12 x layers x hidden x seq_len for attention (PaLM's
    count, causal masking not discounted); the recomputed forward of a stage that is not
    the last is not counted (it is not model work)."""
    h = config.hidden_size
    layers = len(split_layers(config.num_layers, num_stages)[stage_index])
    matmul = layers * (layer_parameters(config) - 2 * h)
    if stage_index == num_stages - 1:
        matmul += config.vocab_size * h
    matmul += bottleneck_parameters(config, num_stages, stage_index)[0]
    return 6 * matmul + 12 * layers * h * seq_len


def bottleneck_parameters(config: ModelConfig, num_stages: int, stage_index: int) -> tuple[int, int]:
    """(matmul parameters, lookup parameters) a bottleneck boundary adds to the stage: the
    encoder of the boundary it sends across, the decoder and anchor of the one it receives."""
    boundary = config.boundary
    if boundary is None or num_stages == 1:
        return 0, 0
    if boundary.kind != "bottleneck":
        raise ValueError(f"a {boundary.kind} boundary is not counted here")
    sends, receives = stage_index < num_stages - 1, stage_index > 0
    h = config.hidden_size
    return (sends + receives) * h * boundary.width, receives * config.vocab_size * h


def card_tokens_per_s(size: str, config: ModelConfig, *, num_stages: int, stage_index: int,
                      seq_len: int) -> float:
    """Tokens a second the stated card (``H200_EAGER_TOKENS_PER_S``) computes of a stage."""
    measured = size if size in H200_EAGER_TOKENS_PER_S else "medium"
    at = model_config(measured, vocab_size=MEASURED_VOCAB, max_seq_len=MEASURED_SEQ)
    kind = int(stage_index == num_stages - 1)
    flops_per_s = H200_EAGER_TOKENS_PER_S[measured][kind] * stage_flops_per_token(
        at, num_stages=2, stage_index=kind, seq_len=MEASURED_SEQ) * CARD_SHARE
    return flops_per_s / stage_flops_per_token(config, num_stages=num_stages, stage_index=stage_index,
                                               seq_len=seq_len)


def uplink_mbit(size: str, *, num_stages: int, codec: str, ratio: float = 32.0, batch: int = 8,
                seq_len: int = 1024, vocab_size: int = 32_000,
                inner_phase_s: float = 60.0) -> tuple[float, float]:
    """(Mbit/s the busiest volunteer's uplink carries, micro-batches a second): at the
    pipeline's rate (its slowest stage on the stated card), each stage sends the
    activations and targets of the boundary after it, the gradients of the one before
    it, and its stage's outer payload within ``inner_phase_s`` (near4-3)."""
    from swarm_node.model.coded import coded_model  # model/coded.py sizes the code from the wire

    config, coded = coded_model(model_config(size, vocab_size=vocab_size, max_seq_len=seq_len),
                                activation_codec=codec, activation_ratio=ratio, batch_size=batch,
                                seq_len=seq_len, num_stages=num_stages)
    tokens_per_s = min(card_tokens_per_s(size, config, num_stages=num_stages, stage_index=s, seq_len=seq_len)
                       for s in range(num_stages))
    forward, gradient = _boundary_bytes(config, coded, codec, batch, seq_len)
    busiest = 0.0
    for s in range(num_stages):
        sent = tokens_per_s * (forward * (s < num_stages - 1) + gradient * (s > 0)) * 8 / 1e6
        params = stage_parameters(config, num_stages=num_stages, stage_index=s) + sum(
            bottleneck_parameters(config, num_stages, s))
        busiest = max(busiest, sent + round_mbit(params, inner_phase_s))
    return busiest, tokens_per_s / (batch * seq_len)


def _boundary_bytes(config: ModelConfig, coded: BoundaryCodec | None, codec: str, batch: int,
                    seq_len: int) -> tuple[float, float]:
    """(forward request, gradient answer) bytes a token across one boundary; for fp16 and
    int8 the frame's header (about 100 bytes a micro-batch) and fp16's scale aside."""
    if coded is not None:
        return bytes_per_token(coded, batch, seq_len)
    values = ACTIVATION_BYTES[codec] * config.hidden_size
    return values + TARGET_BYTES, values


def uplink_table(*, codecs: Sequence[str] = ("fp16", "int8", "bottleneck8"), ratio: float = 32.0,
                 stage_counts: Sequence[int] = (2, 4), inner_phase_s: float = 60.0,
                 longer_phase_s: float = 120.0) -> str:
    """Per named size and stage count: the busiest volunteer's uplink (``uplink_mbit``) in
    each codec with ``inner_phase_s`` of inner steps between rounds, the last codec's
    also with ``longer_phase_s``, each with the smallest home uplink
    (``HOME_UPLINKS_MBIT``) that carries it."""
    names = [f"{c} at {ratio:g}x" if c not in ACTIVATION_BYTES else c for c in codecs]
    names.append(f"{names[-1]}, rounds every {longer_phase_s / 60:g} min")
    lines = ["| model | stages | micro-batches a second | " + " | ".join(names) + " |",
             "|" + "---|" * (4 + len(codecs))]
    for size in NAMED_SIZES:
        if size in TEST_SIZES:
            continue
        for stages in stage_counts:
            figures = [uplink_mbit(size, num_stages=stages, codec=c, ratio=ratio, inner_phase_s=inner_phase_s)
                       for c in codecs]
            figures.append(uplink_mbit(size, num_stages=stages, codec=codecs[-1], ratio=ratio,
                                       inner_phase_s=longer_phase_s))
            cells = [_rate(mbit) + _fits(mbit) for mbit, _ in figures]
            lines.append(f"| {size} | {stages} | {_per_s(figures[0][1])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _per_s(rate: float) -> str:
    return f"{rate:.1f}" if rate >= 1 else f"{rate:.2f}"


def _fits(mbit: float) -> str:
    least = next((link for link in HOME_UPLINKS_MBIT if mbit <= link), None)
    return f" ({least}+)" if least is not None else ""


if __name__ == "__main__":
    print(round_table())
    print()
    print(activation_table())
    print()
    print(uplink_table())

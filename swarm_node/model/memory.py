"""How much memory one pipeline stage needs: a pure estimate from the model's shape,
the split and the micro-batch, with no device involved.

A stage's peak is its resident state plus the larger of two working sets that never
overlap in time (the worker runs them one after the other on one compute thread):

- resident, per parameter: theta, its gradient, Adam's two moments, and for methods
  with an outer step phi, the outer momentum and what an outer round keeps while the
  inner steps go on (40 bytes, 16 without an outer step);
- one micro-batch's forward and backward: the worker recomputes a stage's forward
  when the gradient comes back, so only one micro-batch's activations are alive at a
  time, whatever the number in flight;
- the outer step: Delta, then the new phi and momentum built beside the old ones
  (12 bytes per parameter; 8 more for our own payload decoded from a blockwise codec),
  and temporaries for one tensor at a time.

The activation terms count the tensors autograd saves for this model's layers
(RMSNorm, attention through scaled_dot_product_attention, which keeps q, k, v, the
output and a log-sum-exp, not the seq x seq scores; SwiGLU), counted on CPU and pinned
by tests/unit/test_memory_estimate.py. Not included: the CUDA context and allocator
slack (a few hundred MiB on a GPU), and attention kernels that materialise the scores
(the plain math path, which MPS may take), which add batch x heads x seq^2 x 4 bytes
per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swarm_node.model.config import NAMED_SIZES, ModelConfig, model_config
from swarm_node.model.loss import LOSS_CHUNK_LOGITS, chunk_tokens
from swarm_node.model.stages import split_layers

# Resident bytes per parameter, all fp32.
INNER_STATE_BYTES_PER_PARAMETER = 4 + 4 + 4 + 4  # theta, gradient, Adam m, Adam v
OUTER_STATE_BYTES_PER_PARAMETER = 4 + 4  # phi, outer momentum
# While a round's exchange runs beside the inner steps (ALGORITHM.md section 3.1): theta at
# its boundary, the payload as sent (at most 4 bytes: phi and Delta in 16 bits), and the
# blockwise codecs' error feedback for phi and Delta (kept between rounds). An upper bound.
ROUND_IN_FLIGHT_BYTES_PER_PARAMETER = 4 + 4 + 8
# The outer step's working set: Delta, then the new phi and momentum beside the old ones,
# plus float64 sums and fp32 temporaries for the tensor being updated (16 bytes per
# element measured on the CPU, 4 more for a partner's tensor copied to an accelerator).
# With a blockwise codec, our own payload decoded to fp32 for the group means (8 more).
OUTER_STEP_BYTES_PER_PARAMETER = 4 + 4 + 4 + 8
OUTER_STEP_BYTES_PER_ELEMENT_OF_LARGEST_TENSOR = 16 + 4
# Under bf16 autocast every matmul weight gets a bf16 copy, cached for the forward and
# saved for the backward.
AUTOCAST_WEIGHT_COPY_BYTES = 2
# Cross-entropy keeps fp32 log-probabilities (4 bytes per vocabulary entry and token);
# its backward holds two more fp32 (B, T, V) buffers at its peak (the gradient of the
# log-probabilities and of the logits).
LOSS_SAVED_BYTES_PER_LOGIT = 4
LOSS_BACKWARD_BYTES_PER_LOGIT = 8
# The chunked loss (model/loss.py, when the logits exceed LOSS_CHUNK_LOGITS) keeps the
# gradients of the hidden states (4 bytes per hidden unit and token) and of the head's
# weight (4 bytes per weight) from its forward to its backward, and under autocast the
# weight cast to bf16 (2). Within a chunk, the larger of: its logits and log-probabilities
# (8 bytes per logit), or the softmax gradient in fp32 and the matmul dtype (4 + 2, or 4
# in fp32) beside the weight gradient's product (2 or 4 bytes per weight).
CHUNKED_LOSS_BYTES_PER_LOGIT = 8
# A backward through a block holds gradient buffers of its widest activation.
BLOCK_BACKWARD_BYTES_PER_FFN_UNIT = 8
# A stage's backward starts from a scalar (the loss, or train/worker.py's Pullback) and
# its seed gradient, one fp32 each, rounded up to the allocator's 8 bytes.
BACKWARD_SEED_BYTES = 8 + 8
# On a card, the math libraries' workspaces come from torch's allocator too (cuBLAS and
# cuBLASLt keep tens of MiB a stream; flash attention a little): measured on an H200,
# tiny's stages peaked 20-70 MiB above an estimate without them (BENCHMARKS.md, gpu_step).
KERNEL_WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage needs; ``peak_bytes`` is what must fit on the device."""

    parameters: int
    state_bytes: int  # resident: weights, gradients, optimizer and outer state
    activation_bytes: int  # one micro-batch's forward + backward, at its peak
    outer_step_bytes: int  # the outer step's temporaries
    workspace_bytes: int = 0  # the math libraries' workspaces on a card (KERNEL_WORKSPACE_BYTES)

    @property
    def peak_bytes(self) -> int:
        return self.state_bytes + max(self.activation_bytes, self.outer_step_bytes) + self.workspace_bytes


def layer_parameters(config: ModelConfig) -> int:
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size + 2 * h


def stage_parameters(config: ModelConfig, *, num_stages: int, stage_index: int,
                     layers_per_stage: Sequence[int] | None = None) -> int:
    """Parameters the stage holds: its blocks, the embedding on stage 0, the final norm
    and the LM head on the last stage (the same split as build_stage)."""
    layers = split_layers(config.num_layers, num_stages, layers_per_stage)[stage_index]
    h, vocab = config.hidden_size, config.vocab_size
    count = len(layers) * layer_parameters(config)
    if stage_index == 0:
        count += vocab * h
    if stage_index == num_stages - 1:
        count += h + vocab * h
    return count


def largest_tensor_elements(config: ModelConfig, *, has_layers: bool, is_first: bool, is_last: bool) -> int:
    h = config.hidden_size
    candidates = [h * config.intermediate_size, h * h] if has_layers else [h]
    if is_first or is_last:
        candidates.append(config.vocab_size * h)
    return max(candidates)


def block_activation_bytes_per_token(config: ModelConfig, *, autocast_bf16: bool) -> int:
    """Bytes one decoder block saves for its backward, per token of the micro-batch.

    fp32: two RMSNorms (input, 1/rms, normalised input: 3h + 1 floats each), q, k, v
    and the attention output, its log-sum-exp (one per head), the SwiGLU gate, up,
    activation and product (4 x ffn). bf16 autocast: the norms stay fp32 and keep
    2h + 1 floats each; the matmul inputs are bf16 copies (one per projection: 3h for
    q, k, v, 2h for gate and up), as are q, k, v, the output and the four ffn tensors.
    """
    h, kv, ffn, heads = config.hidden_size, config.num_kv_heads * config.head_dim, \
        config.intermediate_size, config.num_heads
    if autocast_bf16:
        fp32_floats = 2 * (2 * h + 1) + heads
        bf16_values = 3 * h + (2 * h + 2 * kv) + 2 * h + 4 * ffn
        return 4 * fp32_floats + 2 * bf16_values
    return 4 * (2 * (3 * h + 1) + (2 * h + 2 * kv) + heads + 4 * ffn)


def head_activation_bytes_per_token(config: ModelConfig, *, autocast_bf16: bool) -> int:
    """The last stage's final norm, LM head input and loss, per token (saved tensors
    plus the loss backward's peak), and the int64 target."""
    h, vocab = config.hidden_size, config.vocab_size
    logits = (LOSS_SAVED_BYTES_PER_LOGIT + LOSS_BACKWARD_BYTES_PER_LOGIT) * vocab
    if autocast_bf16:
        return 4 * (2 * h + 1) + 2 * h + logits + 8
    return 4 * (3 * h + 1) + logits + 8


def head_activation_bytes(config: ModelConfig, *, tokens: int, autocast_bf16: bool,
                          loss_chunk_logits: int | None = LOSS_CHUNK_LOGITS) -> int:
    """The last stage's head and loss for a micro-batch of ``tokens``: the plain loss's
    per-token figure, or the chunked loss's (model/loss.py) where it chunks."""
    h, vocab = config.hidden_size, config.vocab_size
    chunk = chunk_tokens(vocab, loss_chunk_logits)
    if chunk is None or tokens <= chunk:
        return tokens * head_activation_bytes_per_token(config, autocast_bf16=autocast_bf16)
    norm = 4 * (2 * h + 1) if autocast_bf16 else 4 * (3 * h + 1)  # the final norm's saved tensors
    per_token = norm + 4 * h + 8  # and the gradient of the hidden states, the int64 target
    kept = (4 + 2) * vocab * h if autocast_bf16 else 4 * vocab * h
    gradient_product = (6 if autocast_bf16 else 4) * vocab * chunk + (2 if autocast_bf16 else 4) * vocab * h
    return tokens * per_token + kept + max(CHUNKED_LOSS_BYTES_PER_LOGIT * vocab * chunk, gradient_product)


def estimate_stage_memory(config: ModelConfig, *, num_stages: int, stage_index: int, batch_size: int,
                          seq_len: int, autocast_bf16: bool, outer_state: bool = True,
                          layers_per_stage: Sequence[int] | None = None,
                          loss_chunk_logits: int | None = LOSS_CHUNK_LOGITS) -> StageMemory:
    """The memory stage ``stage_index`` of ``num_stages`` needs to train on micro-batches
    of ``batch_size`` x ``seq_len`` tokens. ``autocast_bf16``: the device trains under
    bf16 autocast (CUDA, compute capability 8.0+); otherwise fp32. ``loss_chunk_logits``:
    the last stage's setting of the same name (None: the plain loss)."""
    layers = split_layers(config.num_layers, num_stages, layers_per_stage)[stage_index]
    is_last = stage_index == num_stages - 1
    parameters = stage_parameters(config, num_stages=num_stages, stage_index=stage_index,
                                  layers_per_stage=layers_per_stage)
    per_parameter = INNER_STATE_BYTES_PER_PARAMETER
    if outer_state:
        per_parameter += OUTER_STATE_BYTES_PER_PARAMETER + ROUND_IN_FLIGHT_BYTES_PER_PARAMETER
    tokens = batch_size * seq_len
    per_token = len(layers) * block_activation_bytes_per_token(config, autocast_bf16=autocast_bf16)
    if not is_last and layers:
        per_token += BLOCK_BACKWARD_BYTES_PER_FFN_UNIT * config.intermediate_size
    per_token += 4 * config.hidden_size  # the stage's input (or embedding output) and its gradient's peer
    activations = tokens * per_token
    if is_last:
        activations += head_activation_bytes(config, tokens=tokens, autocast_bf16=autocast_bf16,
                                             loss_chunk_logits=loss_chunk_logits)
    if autocast_bf16:
        matmul_weights = len(layers) * (layer_parameters(config) - 2 * config.hidden_size)
        if is_last:
            matmul_weights += config.vocab_size * config.hidden_size
        activations += AUTOCAST_WEIGHT_COPY_BYTES * matmul_weights
    if stage_index == 0:
        # The embedding's backward comes last, after the blocks' activations are freed: a
        # dense fp32 (V, H) gradient that is then added into the accumulated one.
        embedding_backward = 4 * config.vocab_size * config.hidden_size + 8 * tokens * config.hidden_size
        activations = max(activations, embedding_backward)
    activations += BACKWARD_SEED_BYTES
    outer_step = 0
    if outer_state:
        largest = largest_tensor_elements(config, has_layers=bool(layers), is_first=stage_index == 0,
                                          is_last=is_last)
        outer_step = (OUTER_STEP_BYTES_PER_PARAMETER * parameters
                      + OUTER_STEP_BYTES_PER_ELEMENT_OF_LARGEST_TENSOR * largest)
    return StageMemory(parameters=parameters, state_bytes=per_parameter * parameters,
                       activation_bytes=activations, outer_step_bytes=outer_step,
                       workspace_bytes=KERNEL_WORKSPACE_BYTES if autocast_bf16 else 0)  # a card (CPUs: fp32)


def largest_stage_memory(config: ModelConfig, *, num_stages: int, batch_size: int, seq_len: int,
                         autocast_bf16: bool, outer_state: bool = True) -> tuple[int, StageMemory]:
    """(stage index, estimate) of the stage with the highest peak under the even split."""
    estimates = [estimate_stage_memory(config, num_stages=num_stages, stage_index=s, batch_size=batch_size,
                                       seq_len=seq_len, autocast_bf16=autocast_bf16, outer_state=outer_state)
                 for s in range(num_stages)]
    index = max(range(num_stages), key=lambda s: estimates[s].peak_bytes)
    return index, estimates[index]


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def per_stage_count(config: ModelConfig, stage_counts: Sequence[int], cell: Callable[[int],
                                                                                     str]) -> list[str]:
    """A table's cells for one model: ``cell(stages)`` for each stage count, "n/a" where
    the layers do not split that way."""
    cells = []
    for stages in stage_counts:
        try:
            split_layers(config.num_layers, stages)
        except ValueError:
            cells.append("n/a")
            continue
        cells.append(cell(stages))
    return cells


def memory_table(*, vocab_size: int = 32_000, batch_size: int = 8, seq_len: int = 1024,
                 stage_counts: Sequence[int] = (1, 2, 4)) -> str:
    """A Markdown table: per named size and stage count, the largest stage's peak on a
    GPU with bf16 autocast and on a CPU (fp32), for a NoLoCo/DiLoCo run."""
    header = "| model | parameters | " + " | ".join(f"{s} stage{'s' if s > 1 else ''}: GPU / CPU"
                                                   for s in stage_counts) + " |"
    lines = [header, "|" + "---|" * (2 + len(stage_counts))]
    for size in NAMED_SIZES:
        config = model_config(size, vocab_size=vocab_size, max_seq_len=seq_len)

        def peaks(stages: int, config: ModelConfig = config) -> str:
            _, gpu = largest_stage_memory(config, num_stages=stages, batch_size=batch_size, seq_len=seq_len,
                                          autocast_bf16=True)
            _, cpu = largest_stage_memory(config, num_stages=stages, batch_size=batch_size, seq_len=seq_len,
                                          autocast_bf16=False)
            return f"{format_bytes(gpu.peak_bytes)} / {format_bytes(cpu.peak_bytes)}"

        cells = per_stage_count(config, stage_counts, peaks)
        lines.append(f"| {size} | {config.num_parameters() / 1e6:,.1f}M | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Vocabularies a host picks from: bytes, a BPE trained by `data prepare` (8k), Llama 2's
# (32k), GPT-2's (50k), Llama 3's (128k).
VOCABULARIES = (256, 8192, 32_000, 50_257, 128_256)


def vocab_table(*, vocabularies: Sequence[int] = VOCABULARIES, num_stages: int = 2, batch_size: int = 8,
                seq_len: int = 1024) -> str:
    """A Markdown table: per named size, the largest stage's peak on a GPU (bf16 autocast)
    for each vocabulary. The vocabulary sizes the embedding (stage 0) and the head and
    its loss (the last stage): vocabulary x hidden parameters each, at 40 bytes of
    resident state apiece, and the logits of a micro-batch."""
    header = "| model | " + " | ".join(f"{v:,}" for v in vocabularies) + " |"
    lines = [header, "|" + "---|" * (1 + len(vocabularies))]
    for size in NAMED_SIZES:
        cells = []
        for vocab in vocabularies:
            config = model_config(size, vocab_size=vocab, max_seq_len=seq_len)

            def peak(stages: int, config: ModelConfig = config) -> str:
                _, need = largest_stage_memory(config, num_stages=stages, batch_size=batch_size,
                                               seq_len=seq_len, autocast_bf16=True)
                return format_bytes(need.peak_bytes)

            cells += per_stage_count(config, [num_stages], peak)
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# What a card holds besides the stage: the CUDA context, the allocator's slack, torch's
# kernels' workspaces.
CARD_RESERVE_BYTES = 2 << 30


def largest_micro_batch(config: ModelConfig, *, num_stages: int, seq_len: int, card_bytes: int,
                        autocast_bf16: bool = True, max_batch: int = 512) -> int | None:
    """The largest power-of-two micro-batch (sequences) whose largest stage fits a card of
    ``card_bytes``, or None when not even one sequence does."""
    best, batch = None, 1
    while batch <= max_batch:
        _, need = largest_stage_memory(config, num_stages=num_stages, batch_size=batch, seq_len=seq_len,
                                       autocast_bf16=autocast_bf16)
        if need.peak_bytes + CARD_RESERVE_BYTES > card_bytes:
            break
        best, batch = batch, 2 * batch
    return best


def micro_batch_table(*, card_gib: float, vocab_size: int = 32_000, seq_len: int = 1024,
                      stage_counts: Sequence[int] = (1, 2, 4)) -> str:
    """A Markdown table: per named size and stage count, the largest micro-batch a card of
    ``card_gib`` GiB holds under bf16 autocast, and its tokens."""
    header = "| model | " + " | ".join(f"{s} stage{'s' if s > 1 else ''}" for s in stage_counts) + " |"
    lines = [header, "|" + "---|" * (1 + len(stage_counts))]
    for size in NAMED_SIZES:
        config = model_config(size, vocab_size=vocab_size, max_seq_len=seq_len)

        def cell(stages: int, config: ModelConfig = config) -> str:
            batch = largest_micro_batch(config, num_stages=stages, seq_len=seq_len,
                                        card_bytes=int(card_gib * 2**30))
            return "does not fit" if batch is None else f"{batch} ({batch * seq_len:,} tokens)"

        lines.append(f"| {size} | " + " | ".join(per_stage_count(config, stage_counts, cell)) + " |")
    return "\n".join(lines)


MICRO_BATCH_ADVICE = """\
batch_size (the micro-batch) and samples_per_step are run-spec settings every peer shares:
- batch_size: the largest the smallest card of the run holds for its stage (above); a GPU
  step needs many tokens per micro-batch to keep the card busy (eager, at 8 x 1024 tokens,
  the small model's single stage used about 16 % of an H100; bench/gpu_step measures your
  card), and more stages leave each card more room for them;
- samples_per_step: the optimizer's batch, a multiple of batch_size; the node accumulates
  samples_per_step / batch_size micro-batches per inner step, so raising batch_size at the
  same samples_per_step changes the speed, not the training (the learning rate and H are
  tuned to samples_per_step x seq_len tokens a step)."""


def build_parser():
    import argparse

    parser = argparse.ArgumentParser(prog="python -m swarm_node.model.memory",
                                     description="Peak memory of a stage, and the micro-batch a card holds.")
    parser.add_argument("--vocab", type=int, default=32_000, help="vocabulary size (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens a sequence (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="micro-batch of the peak table (default %(default)s)")
    parser.add_argument("--card-gib", type=float, default=None, metavar="GIB",
                        help="also: the largest micro-batch a card of this many GiB holds, and advice")
    parser.add_argument("--vocab-costs", action="store_true",
                        help="also: the largest of 2 stages' GPU peak at vocabularies from 256 to 128,256")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    print(f"Peak memory of the largest stage, {args.batch_size} x {args.seq_len}-token micro-batches, "
          f"vocabulary {args.vocab:,}:\n")
    print(memory_table(vocab_size=args.vocab, batch_size=args.batch_size, seq_len=args.seq_len))
    if args.card_gib is not None:
        print(
            f"\nThe largest micro-batch a {args.card_gib:g} GiB card holds "
            f"({format_bytes(CARD_RESERVE_BYTES)} kept "
            f"for the CUDA context), bf16 autocast, {args.seq_len}-token sequences:\n"
        )
        print(micro_batch_table(card_gib=args.card_gib, vocab_size=args.vocab, seq_len=args.seq_len))
        print("\n" + MICRO_BATCH_ADVICE)
    if args.vocab_costs:
        print(f"\nWhat the vocabulary costs: the GPU peak (bf16 autocast) of the largest of 2 stages, "
              f"{args.batch_size} x {args.seq_len}-token micro-batches:\n")
        print(vocab_table(batch_size=args.batch_size, seq_len=args.seq_len))


if __name__ == "__main__":
    main()

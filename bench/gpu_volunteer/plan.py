"""What bench.gpu_volunteer runs, and the arithmetic behind it: the emulated card (from
the H200's eager step times in bench/results/gpu_step.json), the run spec of each
activation codec, what a micro-batch moves across the boundary, the real stages'
parameters and outer payloads, and what the links and the cards allow.

The card: a sixth of the H200's measured eager rate per stage, ``small`` in 2 stages,
micro-batches of 8 x 1024 tokens. gpu_step.json measured a byte vocabulary (256); the
run's 32k vocabulary only changes the last stage's head (the first stage's embedding is
a lookup, no FLOPs), so the last stage's time is scaled by its FLOPs a token with the
32k head over those with the byte head (gpu_step's own count, ``flops_per_token``).

The round: every ``ROUND_S`` of inner steps, at the pace the codec's pipeline is
expected to run (the slower of the card and the link for a micro-batch), so every codec
has its outer round beside its inner steps on the same links."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cache

import torch

from bench.common.results import load
from bench.gpu_step.benchmark import flops_per_token
from bench.gpu_volunteer.emulation import EmulatedCard
from swarm_node.data.spec import DataSpec
from swarm_node.model.config import ModelConfig
from swarm_node.model.memory import stage_parameters
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.hop_work import forward_request
from swarm_node.wire.activations import encode_activations
from swarm_node.wire.frames import encode_frame
from swarm_node.wire.outer_codec import outer_codec

MODEL = "small"
STAGES = 2
VOLUNTEERS_PER_STAGE = 2
BATCH, SEQ = 8, 1024
VOCAB = 32_000
CARD_SHARE = 1 / 6  # a consumer card against the H200
GPU_STEP_MODE = "baseline"  # eager, unfused: what the "eager" rate is
FORWARD_SHARE = 0.25  # a non-last stage: forward 2 FLOPs a parameter, recompute 2, backward 4
RATE_MBIT = 20.0  # each way, every volunteer's access link
RTT_MS = 30.0  # between two volunteers: 15 ms on each one's access link
ROUND_S = 60.0
DATA = "synthetic:alphabet=16,order=2,tokens=2000000"
CODECS: tuple[tuple[str, float | None], ...] = (("fp16", None), ("int8", None), ("bottleneck8", 32.0))


@dataclass(frozen=True)
class Plan:
    """The measured window of each run: after the warm-up, at least ``window_s``, then
    until every volunteer has closed ``rounds`` outer rounds in it (with a partner or
    local-only), at most ``max_window_s``."""

    window_s: float
    rounds: int
    max_window_s: float
    reference_window_s: float = 60.0  # the coded boundary on unshaped links: a window of this, no rounds
    warmup_microbatches: int = 1  # each stage-0 volunteer's, before the window opens
    sample_s: float = 10.0  # how often the volunteers' /api/status is read in the window

    def reference(self) -> Plan:
        return dataclasses.replace(self, window_s=self.reference_window_s, rounds=0,
                                   max_window_s=self.reference_window_s)


QUICK = Plan(window_s=90.0, rounds=1, max_window_s=180.0)
FULL = Plan(window_s=600.0, rounds=5, max_window_s=1200.0, reference_window_s=300.0)


def codec_name(codec: str, ratio: float | None) -> str:
    return codec if ratio is None else f"{codec} at {ratio:g}x"


def run_spec(codec: str, ratio: float | None, inner_steps: int) -> RunSpec:
    return RunSpec(run_id=f"gpu-volunteer-{codec}", model_size=MODEL, num_stages=STAGES, seq_len=SEQ,
                   batch_size=BATCH, samples_per_step=BATCH, total_steps=100_000, data=DataSpec.parse(DATA),
                   activation_codec=codec, activation_ratio=ratio,
                   method=default_method("noloco", inner_steps=inner_steps),
                   inner=InnerHyper(lr=1e-3, warmup_steps=10, total_steps=100_000))


# -- the card -----------------------------------------------------------------------------
@dataclass(frozen=True)
class CardTimes:
    """Seconds of the emulated card a micro-batch, per stage, and where they came from."""

    stage_s: tuple[float, ...]
    h200_step_s: tuple[float, ...]  # the H200's, as measured
    vocab_measured: int
    head_scale: float  # the last stage's time times this: the 32k head's FLOPs (1.0: measured at 32k)

    def note(self) -> str:
        scaled = ("" if self.head_scale == 1.0 else
                  f"; the last stage's scaled by {self.head_scale:.3f}, its FLOPs a token with the "
                  f"{VOCAB:,}-token head over those with the {self.vocab_measured}-token head gpu_step.json "
                  "measured")
        return (f"EMULATED card: 1/{1 / CARD_SHARE:.0f} of the H200's eager rate ({GPU_STEP_MODE} mode of "
                f"bench/results/gpu_step.json, {MODEL} in {STAGES} stages, {BATCH} x {SEQ} tokens): H200 "
                + ", ".join(f"stage {i} {s * 1e3:.1f} ms" for i, s in enumerate(self.h200_step_s))
                + " a micro-batch, emulated "
                + ", ".join(f"{s * 1e3:.0f} ms" for s in self.stage_s) + scaled)


def card_times(gpu_step: dict | None = None) -> CardTimes:
    """The emulated card's time a micro-batch per stage, from gpu_step.json's rows for
    ``MODEL`` in ``STAGES`` stages in eager mode (the 32k vocabulary's rows if it has
    them, else the byte vocabulary's, the last stage scaled by the 32k head's FLOPs)."""
    gpu_step = gpu_step if gpu_step is not None else load("gpu_step")
    if gpu_step is None:
        raise FileNotFoundError("bench/results/gpu_step.json: run bench/gpu_step on a CUDA machine first")
    rows = [r for r in gpu_step["rows"] if r["size"] == MODEL and r["stages"] == STAGES
            and r["mode"] == GPU_STEP_MODE and r["batch_size"] == BATCH and r["seq_len"] == SEQ]
    vocabs = {r["vocab"] for r in rows}
    if not vocabs:
        raise ValueError(f"gpu_step.json has no {GPU_STEP_MODE} rows for {MODEL} in {STAGES} stages")
    vocab = VOCAB if VOCAB in vocabs else max(vocabs)
    by_stage = {r["stage"]: r for r in rows if r["vocab"] == vocab}
    if sorted(by_stage) != list(range(STAGES)):
        raise ValueError(f"gpu_step.json lacks a stage of {MODEL} in {STAGES} stages at vocabulary {vocab}")
    h200 = tuple(by_stage[s]["step_s"] for s in range(STAGES))
    last = STAGES - 1
    spec = RunSpec(model_size=MODEL, num_stages=STAGES, seq_len=SEQ, batch_size=BATCH, samples_per_step=BATCH)
    head_scale = flops_per_token(spec, last, VOCAB) / by_stage[last]["flops_per_token"]
    stage_s = tuple(s / CARD_SHARE * (head_scale if i == last else 1.0) for i, s in enumerate(h200))
    return CardTimes(stage_s, h200, vocab, head_scale)


def stage_parameter_count(config: ModelConfig, stage: int, stages: int) -> int:
    """Parameters a stage of ``config`` holds, its coded boundary's layers included (a
    bottleneck's encoder on the sending stage, its decoder and anchor embedding on the
    receiving one, model/boundary.py)."""
    count = stage_parameters(config, num_stages=stages, stage_index=stage)
    boundary = config.boundary
    if boundary is None:
        return count
    if boundary.kind != "bottleneck":
        raise ValueError(f"no count for a {boundary.kind} boundary here")
    hidden = config.hidden_size
    sends, receives = stage < stages - 1, stage > 0
    decoder_and_anchor = boundary.width * hidden + config.vocab_size * hidden
    return count + sends * hidden * boundary.width + receives * decoder_and_anchor


def real_parameters(codec: str, ratio: float | None) -> tuple[int, ...]:
    """Per stage: the parameters of the real stage of the run's model."""
    config, _ = run_spec(codec, ratio, 1).model(VOCAB)
    return tuple(stage_parameter_count(config, s, STAGES) for s in range(STAGES))


def card(codec: str, ratio: float | None, times: CardTimes | None = None) -> EmulatedCard:
    times = times or card_times()
    return EmulatedCard(stage_s=times.stage_s, forward_share=FORWARD_SHARE, vocab_size=VOCAB,
                        real_params=real_parameters(codec, ratio))


# -- the boundary and the links -------------------------------------------------------------
@cache
def boundary_bytes(codec: str, ratio: float | None) -> tuple[int, int]:
    """(forward request, gradient answer) bytes of one micro-batch across the boundary, as
    the node frames them: values, scales, headers, and the targets or token ids."""
    spec = run_spec(codec, ratio, 1)
    config, coded = spec.model(VOCAB)
    if coded is not None:
        return coded.request_bytes(BATCH, SEQ), coded.answer_bytes(BATCH, SEQ)
    hidden = torch.zeros(BATCH, SEQ, config.hidden_size)
    header = {"kind": "fwd", "spec": spec.spec_hash(), "deadline_s": 300.0}
    request = forward_request(header, hidden, torch.zeros(BATCH, SEQ, dtype=torch.long), codec)
    answer = encode_frame({"ok": True, "loss": 1.0}, encode_activations(hidden, codec))
    return len(request), len(answer)


def link_s(nbytes: float) -> float:
    """Seconds ``nbytes`` take on one direction of an access link."""
    return nbytes * 8 / (RATE_MBIT * 1e6)


def microbatch_s(codec: str, ratio: float | None, times: CardTimes) -> float:
    """The pace a stage-0 volunteer is expected to run at: a micro-batch per the slower of
    the slowest card and its link (each volunteer's link carries its share of the
    boundary's traffic: 2 a stage, every stage-1 link takes what one stage-0 link sends)."""
    return max(*times.stage_s, *(link_s(b) for b in boundary_bytes(codec, ratio)))


def inner_steps(codec: str, ratio: float | None, times: CardTimes) -> int:
    """H: ``ROUND_S`` of inner steps at the codec's expected pace (a micro-batch a step)."""
    return max(1, round(ROUND_S / microbatch_s(codec, ratio, times)))


def link_tokens_per_s(codec: str, ratio: float | None) -> float:
    """Stage 0's tokens/s the links allow, with nothing else on them: each stage-0
    volunteer's uplink full of forward requests (and each stage-1 link of gradients)."""
    request, answer = boundary_bytes(codec, ratio)
    return VOLUNTEERS_PER_STAGE * BATCH * SEQ / link_s(max(request, answer))


def card_tokens_per_s(times: CardTimes) -> float:
    """Stage 0's tokens/s the cards allow: the slowest stage's volunteers all computing."""
    return VOLUNTEERS_PER_STAGE * BATCH * SEQ / max(times.stage_s)


def outer_payload_bytes(codec: str, ratio: float | None) -> tuple[int, ...]:
    """Per stage: one outer payload (phi and Delta) of the real stage, each way, in the run's codec."""
    per_param = outer_codec(RunSpec().outer_codec).bytes_per_parameter()
    return tuple(math.ceil(n * per_param) for n in real_parameters(codec, ratio))

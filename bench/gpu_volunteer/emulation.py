"""An EMULATED GPU card inside a real swarm-node: what bench.gpu_volunteer's volunteers
run (bench/gpu_volunteer/card.py installs it, then runs ``swarm-node join``).

Everything but the card is the node's own code: the data path and its pacing
(routing/window.py), the peer choice, the deadlines, the wire codecs and their checks,
the outer rounds and their pairing, on the test bed's shaped links. What is emulated:

- the card: a stage's forward, backward and loss are a timed wait of the card's time for
  the micro-batch (``EmulatedCard.stage_s``; a stage that is not the last spends
  ``forward_share`` of it in the forward, the rest in the recomputed forward and the
  backward), returning real tensors of the real shapes (activations or, with a coded
  boundary, its code; their gradients) drawn once from a seeded pool, which the node then
  encodes, sends, decodes and screens as it would a card's. The wait counts as training
  time (StageWorker's ``training_s``), as a card's compute does;
- the weights: dropped. The node holds a stand-in of ``stand_in_numel`` parameters
  (real tensors, stepped by the real inner optimizer on emulated gradients, so that its
  rounds have a Delta to send, check and apply), and each part of its outer payload
  (phi, Delta) is padded with bytes to what the real stage's parameters take in the
  run's outer codec; the exchange's deadlines and frame limits are those of the real
  payload. A receiver checks the padding and drops it;
- the vocabulary: the model is built for ``vocab_size`` tokens (the data's ids are
  fewer: they travel at the vocabulary's width all the same).

Nothing here is used by swarm_node itself."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from swarm_node.errors import ProtocolError
from swarm_node.gossip import payloads
from swarm_node.gossip.payloads import PayloadSwap
from swarm_node.model.boundary import seeded_normal
from swarm_node.model.config import ModelConfig
from swarm_node.node_config import NodeConfig
from swarm_node.train import worker as worker_module
from swarm_node.train.worker import OpenRound, StageWorker, _training_work
from swarm_node.wire.outer_codec import OuterCodec, part_tensors

ACTIVATION_STD = 1.0  # the emulated activations' (or code's) scale
GRADIENT_STD = 1e-3  # and their gradients' (bench/gpu_step draws its gradients so)
STAND_IN_STD = 0.02
STAND_IN_GRAD_STD = 1e-3
STAND_IN_COLUMNS = 256


@dataclass(frozen=True)
class EmulatedCard:
    """An emulated card, the same on every volunteer of a run."""

    stage_s: tuple[float, ...]  # seconds of the card a micro-batch, per stage (forward and backward)
    forward_share: float  # of a non-last stage's time: its forward (the rest: recompute and backward)
    vocab_size: int
    real_params: tuple[int, ...]  # per stage: the parameters the real stage holds
    stand_in_numel: int = 64 * STAND_IN_COLUMNS
    pool: int = 4  # distinct tensors of each shape handed out in turn
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.stage_s or any(not (s > 0 and math.isfinite(s)) for s in self.stage_s):
            raise ValueError(f"stage times must be positive, got {self.stage_s}")
        if len(self.real_params) != len(self.stage_s):
            raise ValueError("one parameter count a stage")
        if not 0 < self.forward_share < 1:
            raise ValueError(f"forward_share must be in (0, 1), got {self.forward_share}")
        if self.stand_in_numel % STAND_IN_COLUMNS or self.stand_in_numel <= 0 or self.pool < 1:
            raise ValueError("the stand-in is whole rows of STAND_IN_COLUMNS; the pool at least 1")

    def forward_s(self, stage: int) -> float:
        return self.forward_share * self.stage_s[stage]

    def backward_s(self, stage: int) -> float:
        return self.stage_s[stage] - self.forward_s(stage)

    def padding(self, codec: OuterCodec, stage: int, phi_bytes: int, delta_bytes: int) -> tuple[int, int]:
        """Bytes to add to phi and to Delta, as the stand-in encodes them (``phi_bytes``,
        ``delta_bytes``), so that each is what the real stage's takes in ``codec``."""
        total = self.real_params[stage] * codec.bytes_per_parameter()
        real_delta = round(total * codec.delta_share())
        return max(0, round(total) - real_delta - phi_bytes), max(0, real_delta - delta_bytes)

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(dataclasses.asdict(self)))
        return path

    @classmethod
    def read(cls, path: Path) -> EmulatedCard:
        raw = json.loads(Path(path).read_text())
        return cls(**{**raw, "stage_s": tuple(raw["stage_s"]), "real_params": tuple(raw["real_params"])})


class StandInStage(nn.Module):
    """What an emulated card's node holds instead of its stage: the stage's config and
    place in the pipeline, and a few real parameters for the inner and outer steps."""

    def __init__(self, config: ModelConfig, stage_index: int, num_stages: int, numel: int, seed: int):
        super().__init__()
        self.config, self.stage_index, self.num_stages = config, stage_index, num_stages
        shape = (numel // STAND_IN_COLUMNS, STAND_IN_COLUMNS)
        self.weight = nn.Parameter(seeded_normal(seed, f"stand-in.{stage_index}", shape, STAND_IN_STD))

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


class TensorPool:
    """``size`` seeded tensors of each shape asked for, handed out in turn: values are
    drawn once, not for every micro-batch (drawing 6M values takes a CPU longer than
    some of the card's waits)."""

    def __init__(self, seed: int, size: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.size = size
        self._tensors: dict[tuple, list[torch.Tensor]] = {}
        self._turn: dict[tuple, int] = {}

    def take(self, shape: tuple[int, ...], std: float) -> torch.Tensor:
        key = (tuple(shape), std)
        if key not in self._tensors:
            self._tensors[key] = [torch.randn(*shape, generator=self.generator) * std
                                  for _ in range(self.size)]
            self._turn[key] = 0
        turn = self._turn[key]
        self._turn[key] = (turn + 1) % self.size
        return self._tensors[key][turn]


# -- the card ---------------------------------------------------------------------------
_card: EmulatedCard | None = None


def _hold(started: float, seconds: float) -> None:
    """The card computes until ``seconds`` after ``started``."""
    left = started + seconds - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _pool(worker: StageWorker) -> TensorPool:
    pool = getattr(worker, "_card_pool", None)
    if pool is None:
        pool = worker._card_pool = TensorPool(_card.seed * 1000 + worker.stage.stage_index, _card.pool)
    return pool


def output_width(worker: StageWorker) -> int:
    """Values a token a non-last stage sends: the coded boundary's width, else the hidden size."""
    return worker.boundary.width if worker.boundary is not None else worker.model_config.hidden_size


def _gradients(worker: StageWorker) -> None:
    """Emulated gradients for the stand-in: its inner steps move it as training would."""
    for p in worker.params:
        g = torch.randn(p.shape, generator=_pool(worker).generator) * STAND_IN_GRAD_STD
        p.grad = g if p.grad is None else p.grad + g


@_training_work
def emulated_forward(self: StageWorker, inputs: torch.Tensor,
                     labels: torch.Tensor | None = None) -> torch.Tensor:
    started = time.perf_counter()
    out = _pool(self).take((inputs.shape[0], inputs.shape[1], output_width(self)), ACTIVATION_STD)
    _hold(started, _card.forward_s(self.stage.stage_index))
    return out


@_training_work
def emulated_backward(self: StageWorker, inputs: torch.Tensor, grad_output: torch.Tensor,
                      labels: torch.Tensor | None = None) -> torch.Tensor | None:
    started = time.perf_counter()
    expected = (inputs.shape[0], inputs.shape[1], output_width(self))
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"a gradient of shape {tuple(grad_output.shape)} for an output of {expected}")
    _gradients(self)
    self._accumulated(len(inputs))
    grad = None if self.is_first else _pool(self).take(tuple(inputs.shape), GRADIENT_STD)
    _hold(started, _card.backward_s(self.stage.stage_index))
    return grad


@_training_work
def emulated_forward_backward_last(self: StageWorker, hidden: torch.Tensor | None, targets: torch.Tensor,
                                   token_inputs: torch.Tensor | None = None
                                   ) -> tuple[float, torch.Tensor | None]:
    started = time.perf_counter()
    x = token_inputs if self.is_first else hidden
    window = 1 if self.boundary is not None and not self.is_first else 0  # the window's ids, one more
    if tuple(targets.shape) != (x.shape[0], x.shape[1] + window):
        raise ValueError(f"targets of shape {tuple(targets.shape)} for inputs of {tuple(x.shape)}")
    _gradients(self)
    self._accumulated(len(targets))
    value = math.log(self.model_config.vocab_size)  # emulated: no model, no loss
    self.loss_ema = value if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * value
    grad = None if self.is_first else _pool(self).take(tuple(hidden.shape), GRADIENT_STD)
    _hold(started, _card.stage_s[self.stage.stage_index])
    return value, grad


# -- the weights: a stand-in, the outer payload padded to the real stage's ------------------
_padding_cache: dict[int, torch.Tensor] = {}


def _pad(nbytes: int) -> torch.Tensor:
    """``nbytes`` of padding (seeded noise, drawn once a size)."""
    if nbytes not in _padding_cache:
        _padding_cache[nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                               generator=torch.Generator().manual_seed(nbytes))
    return _padding_cache[nbytes]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def padding_bytes(worker: StageWorker) -> int:
    """What padding adds to this stage's outer payload, both parts."""
    codec, numel = worker.codec, sum(p.numel() for p in worker.params)
    phi = round(numel * codec.bytes_per_parameter() * (1 - codec.delta_share()))
    delta = round(numel * codec.bytes_per_parameter() * codec.delta_share())
    return sum(_card.padding(codec, worker.stage.stage_index, phi, delta))


_honest_open_round = StageWorker.open_round
_honest_decode_payload = StageWorker.decode_payload
_honest_decode_part = StageWorker.decode_part
_honest_payload_swap_init = PayloadSwap.__init__
_honest_exchange_link_s = NodeConfig.exchange_link_s
_honest_worker_init = StageWorker.__init__


def padded_open_round(self: StageWorker, overlapped: bool = False) -> OpenRound:
    """The round's wire as the stand-in encodes it, each part followed by its padding."""
    opened = _honest_open_round(self, overlapped)
    n_phi = part_tensors(self.codec, "phi", len(self.params))
    phi, delta = opened.wire[:n_phi], opened.wire[n_phi:]
    phi_pad, delta_pad = _card.padding(self.codec, self.stage.stage_index, _nbytes(phi), _nbytes(delta))
    self.open = dataclasses.replace(opened, wire=[*phi, _pad(phi_pad), *delta, _pad(delta_pad)])
    return self.open


def unpadded_decode_payload(self: StageWorker, wire, device: torch.device):
    n_phi = part_tensors(self.codec, "phi", len(self.params))
    n_delta = part_tensors(self.codec, "delta", len(self.params))
    if len(wire) != n_phi + n_delta + 2 or not _padding_like(wire[n_phi]) or not _padding_like(wire[-1]):
        raise ProtocolError("an outer payload without an emulated card's padding")
    return _honest_decode_payload(self, [*wire[:n_phi], *wire[n_phi + 1:-1]], device)


def unpadded_decode_part(self: StageWorker, tensors, part: str, device: torch.device):
    if not tensors or not _padding_like(tensors[-1]):
        raise ProtocolError(f"an outer {part} without an emulated card's padding")
    return _honest_decode_part(self, list(tensors[:-1]), part, device)


def _padding_like(t: torch.Tensor) -> bool:
    """Padding as a partner sends it: bytes, one dimension, no more than a real stage's payload."""
    most = max(_card.real_params) * 8
    return t.dtype == torch.uint8 and t.dim() == 1 and t.numel() <= most


def payload_swap_init(self: PayloadSwap, *args, **kwargs) -> None:
    """Frames as large as the real stage's payload are accepted."""
    _honest_payload_swap_init(self, *args, **kwargs)
    state = self.state
    if isinstance(state, StageWorker):
        extra = padding_bytes(state)
        limits = self.limits
        self.limits = dataclasses.replace(limits, max_payload_bytes=limits.max_payload_bytes + extra,
                                          max_tensors=limits.max_tensors + 2)


def real_exchange_link_s(self: NodeConfig, payload_bytes: int) -> float:
    """The exchange's deadlines are the real payload's (the node computes them from its
    stand-in's parameters)."""
    worker = _workers[-1] if _workers else None
    extra = padding_bytes(worker) if worker is not None else 0
    return _honest_exchange_link_s(self, payload_bytes + extra)


def _phi_part_with_padding(codec: OuterCodec, part: str, parameters: int) -> int:
    """payloads.py splits the wire at phi's last tensor: here its padding."""
    return part_tensors(codec, part, parameters) + (1 if part == "phi" else 0)


_workers: list[StageWorker] = []


def card_worker_init(self: StageWorker, spec, stage_index: int, vocab_size: int, device: str = "cpu") -> None:
    _honest_worker_init(self, spec, stage_index, _card.vocab_size, device)
    _workers.append(self)
    shape = (spec.batch_size, spec.seq_len, output_width(self))  # drawn now, not in the first micro-batch
    if not self.is_last:
        _pool(self).take(shape, ACTIVATION_STD)
    if not self.is_first:
        _pool(self).take(shape, GRADIENT_STD)
    real = _card.real_params[stage_index]
    stand_in = sum(p.numel() for p in self.params)
    print(f"EMULATED GPU (bench/gpu_volunteer): stage {stage_index} computes "
          f"{_card.stage_s[stage_index]:.4f} s a micro-batch on an emulated card (a timed wait, real tensors "
          f"of the real shapes); weights dropped: a stand-in of {stand_in:,} parameters, its outer payload "
          f"padded to the real stage's {real:,} parameters in {spec.outer_codec} "
          f"({real * self.codec.bytes_per_parameter() / 1e6:.1f} MB); vocabulary {_card.vocab_size}",
          file=sys.stderr, flush=True)


def stand_in_stage(config: ModelConfig, *, num_stages: int, stage_index: int, seed: int,
                   layers_per_stage=None, device=None) -> StandInStage:
    stage = StandInStage(config, stage_index, num_stages, _card.stand_in_numel, seed)
    return stage.to(device) if device is not None else stage


_PATCHES = (  # (owner, attribute, emulated)
    (worker_module, "build_stage", stand_in_stage),
    (StageWorker, "__init__", card_worker_init),
    (StageWorker, "forward", emulated_forward),
    (StageWorker, "backward", emulated_backward),
    (StageWorker, "forward_backward_last", emulated_forward_backward_last),
    (StageWorker, "open_round", padded_open_round),
    (StageWorker, "decode_payload", unpadded_decode_payload),
    (StageWorker, "decode_part", unpadded_decode_part),
    (PayloadSwap, "__init__", payload_swap_init),
    (payloads, "part_tensors", _phi_part_with_padding),
    (NodeConfig, "exchange_link_s", real_exchange_link_s),
)


@contextmanager
def installed(card: EmulatedCard) -> Iterator[None]:
    """Every node built in this process inside the block has the emulated ``card``
    (card.py installs it for the node's whole life; tests for a block)."""
    global _card
    honest = [(owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
              for owner, name, _ in _PATCHES]
    _card = card
    for owner, name, emulated in _PATCHES:
        setattr(owner, name, emulated)
    try:
        yield
    finally:
        for owner, name, value in honest:
            setattr(owner, name, value)
        _card = None
        _workers.clear()

"""Stage boundaries that carry a few values a token instead of the whole hidden state
(docs/ALGORITHM.md section 9). Pure torch; how the values are coded on the wire is
wire/boundary.py.

At a boundary the residual stream is split into a part the receiver can make itself
from the token ids (which travel anyway: the last stage needs the targets) and a part
that is sent as ``width`` coefficients a token:

- ``bottleneck``: a learned linear encoder on the sending stage maps the residual
  stream minus the sender's own token part to ``width`` values; on the receiving stage
  a learned linear decoder maps them back and the receiver adds its own token
  embedding (an "anchor", a full embedding table of its own). Encoder, decoder and
  anchor are ordinary weights of their stage: trained end to end, averaged by their
  stage's outer rounds. Both start from one orthonormal basis drawn from the run's
  seed (encoder U^T, decoder U) and the anchor from the input embedding's initial
  values, so at step 0 the receiver gets the sender's stream projected on U.
- ``subspace``: every output projection that writes into the residual stream before
  the last boundary (attention's o_proj and the MLP's down_proj) is U A with a fixed
  basis U (width columns, drawn from the run's seed, the same on every stage) and A
  trained; the input embedding is a fixed table T drawn from the seed plus B U^T with B
  trained. The stream at a boundary is then T[token] + U c exactly: c = U^T (x - T[token])
  is sent and the receiver rebuilds x. The model is a plain Llama whose weights
  happen to lie in a subspace (exported by multiplying out), and the gradient sent back,
  U^T dL/dx, is exact. U and T are never trained, never sent and never averaged.

Both send the gradient with respect to the coefficients back: ``width`` values a token
each way. A model whose stages are cut at ``cuts`` holds boundary i between layer
``cuts[i] - 1`` and layer ``cuts[i]``; the unsplit model (one stage) holds every
boundary inside it, so it computes what the split one does without the wire's rounding.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BOUNDARY_KINDS = ("bottleneck", "subspace")


@dataclass(frozen=True)
class BoundaryConfig:
    """What crosses stage boundaries: ``width`` values a token, by ``kind``, at the
    layer counts ``cuts`` (boundary i sits before global layer ``cuts[i]``)."""

    kind: str
    width: int
    cuts: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in BOUNDARY_KINDS:
            raise ValueError(f"boundary kind must be one of {BOUNDARY_KINDS}, got {self.kind!r}")
        if type(self.width) is not int or self.width < 1:
            raise ValueError(f"boundary width must be a positive whole number, got {self.width!r}")
        if not self.cuts or list(self.cuts) != sorted(set(self.cuts)) or self.cuts[0] < 0:
            raise ValueError(f"boundary cuts must be increasing and non-negative, got {self.cuts!r}")


def seeded_normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """N(0, std) values that depend only on (seed, name): how every weight is drawn
    (model/stages.py), so a stage built alone matches the unsplit model."""
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)
    return torch.randn(shape, generator=torch.Generator().manual_seed(key), dtype=torch.float32) * std


def seeded_basis(seed: int, name: str, hidden: int, width: int) -> torch.Tensor:
    """A (hidden, width) matrix with orthonormal columns drawn from (seed, name)."""
    q, r = torch.linalg.qr(seeded_normal(seed, name, (hidden, width), 1.0).double())
    return (q * torch.sign(torch.diagonal(r))).float()  # signs fixed: QR alone leaves them to LAPACK


class SubspaceLinear(nn.Module):
    """A linear map whose output lies in the span of a fixed basis: ``weight`` (width x
    in) holds the coefficients, the map is basis @ weight. Trained, averaged and sent
    as any weight; the basis is a buffer filled from the run's seed (init_weights)."""

    def __init__(self, in_features: int, out_features: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, in_features))
        self.register_buffer("basis", torch.zeros(out_features, width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.weight), self.basis)

    def full_weight(self) -> torch.Tensor:
        """The (out, in) weight of the plain linear map this one is."""
        return self.basis @ self.weight


class SubspaceEmbedding(nn.Module):
    """The trained part of a ``subspace`` model's input embedding: token t adds basis @
    weight[t] to the fixed table's row (Boundaries.fixed), ``weight`` (vocab x width)."""

    def __init__(self, vocab_size: int, hidden: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, width))
        self.register_buffer("basis", torch.zeros(hidden, width), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(F.embedding(ids, self.weight), self.basis)


class FixedTokens(nn.Module):
    """The fixed token table and basis of a ``subspace`` boundary on a receiving stage."""

    def __init__(self, vocab_size: int, hidden: int, width: int):
        super().__init__()
        self.register_buffer("table", torch.zeros(vocab_size, hidden), persistent=False)
        self.register_buffer("basis", torch.zeros(hidden, width), persistent=False)


class BottleneckSide(nn.Module):
    """One ``bottleneck`` boundary's weights held by a stage: the encoder on the sending
    stage, the decoder and the anchor embedding on the receiving one (both in the unsplit
    model)."""

    def __init__(self, hidden: int, width: int, vocab_size: int, *, sends: bool, receives: bool):
        super().__init__()
        self.hidden, self.width = hidden, width
        if sends:
            self.encoder = nn.Linear(hidden, width, bias=False)
        if receives:
            self.decoder = nn.Linear(width, hidden, bias=False)
            self.anchor = nn.Embedding(vocab_size, hidden)


class Boundaries(nn.Module):
    """The boundary parts of one stage (or, unsplit, of the whole model) and the
    computation across them. A "token part" is what the stream holds of the token
    embedding at a point: the part a receiver makes itself from the ids, never sent."""

    def __init__(self, config: BoundaryConfig, hidden: int, vocab_size: int, indices: range, *,
                 receives: int | None, sends: int | None):
        """Boundaries ``indices`` touch this stage; it receives ``receives`` (None: it is
        the model's first stage) and sends ``sends`` (None: the last); the others lie
        inside it."""
        super().__init__()
        self.config = config
        self.receives, self.sends = receives, sends
        if config.kind == "bottleneck":
            self.sides = nn.ModuleDict({str(i): BottleneckSide(
                hidden, config.width, vocab_size, sends=i != receives, receives=i != sends) for i in indices})
        else:
            self.fixed = FixedTokens(vocab_size, hidden, config.width)

    def first_token_part(self, tokens: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The token part of the stream right after the input embedding (``embedded``)."""
        return embedded if self.config.kind == "bottleneck" else F.embedding(tokens, self.fixed.table)

    def code(self, index: int, hidden: torch.Tensor, token_part: torch.Tensor) -> torch.Tensor:
        """The (B, T, width) values boundary ``index`` sends for ``hidden``."""
        if self.config.kind == "bottleneck":
            return self.sides[str(index)].encoder(hidden - token_part)
        return F.linear(hidden - token_part, self.fixed.basis.t())

    def rebuild(self, index: int, code: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor,
                                                                                     torch.Tensor]:
        """(hidden, token part) after boundary ``index``, from its ``code`` and the tokens."""
        if self.config.kind == "bottleneck":
            side = self.sides[str(index)]
            token_part = side.anchor(tokens)
            return side.decoder(code) + token_part, token_part
        token_part = F.embedding(tokens, self.fixed.table)
        return token_part + F.linear(code, self.fixed.basis), token_part


def constrained_layers(config: BoundaryConfig | None) -> range:
    """Global layer indices whose residual writes must lie in the fixed subspace."""
    if config is None or config.kind != "subspace":
        return range(0)
    return range(config.cuts[-1])


@torch.no_grad()
def init_boundary(module: nn.Module, name: str, seed: int, std: float) -> bool:
    """Fills a boundary part's parameters or fixed buffers from the seed; False if
    ``module`` is not one (model/stages.py initialises the rest)."""
    if isinstance(module, BottleneckSide):
        index = name.rsplit(".", 1)[-1]
        encoder, decoder = getattr(module, "encoder", None), getattr(module, "decoder", None)
        basis = seeded_basis(seed, f"boundary.{index}.basis", module.hidden, module.width)
        if encoder is not None:
            encoder.weight.copy_(basis.t())
        if decoder is not None:
            decoder.weight.copy_(basis)
            # the input embedding's initial values: the receiver's token part starts as the sender's
            module.anchor.weight.copy_(seeded_normal(seed, "model.embed_tokens.weight",
                                                     tuple(module.anchor.weight.shape), std))
        return True
    if isinstance(module, FixedTokens):
        hidden, width = module.basis.shape
        module.basis.copy_(seeded_basis(seed, "boundary.basis", hidden, width))
        # the plain model's initial embedding: a subspace model starts where a plain one does
        module.table.copy_(seeded_normal(seed, "model.embed_tokens.weight", tuple(module.table.shape), std))
        return True
    if isinstance(module, SubspaceEmbedding):
        hidden, width = module.basis.shape
        module.basis.copy_(seeded_basis(seed, "boundary.basis", hidden, width))
        module.weight.zero_()
        return True
    if isinstance(module, SubspaceLinear):
        hidden, width = module.basis.shape
        module.basis.copy_(seeded_basis(seed, "boundary.basis", hidden, width))
        return False  # its coefficients are drawn as any residual projection's
    return False


@torch.no_grad()
def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A ``subspace`` model's (or stage's) weights as the plain Llama it is: every
    constrained projection and the input embedding multiplied out to their full shape,
    under the same names. A ``bottleneck`` model has no plain form (its boundaries are
    layers of their own): ValueError."""
    boundaries = getattr(model, "boundaries", None)
    if boundaries is not None and boundaries.config.kind != "subspace":
        raise ValueError("a bottleneck model is not a plain Llama: export it with its boundary layers")
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, SubspaceLinear):
            state[f"{name}.weight"] = module.basis @ module.weight
        elif isinstance(module, SubspaceEmbedding):
            state[f"{name}.weight"] = boundaries.fixed.table + module.weight @ module.basis.t()
    return state

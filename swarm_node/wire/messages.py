"""The messages peers send each other, checked: every request and answer a node takes
from another peer passes one of these before anything else looks at it. Pure
functions on decoded frames (wire/frames.py checks the frame itself); what a failed
check costs the sender is decided where the message is handled (net/guard.py).

Statistical screens (is this update or activation out of scale?) need history and
live with their users: train/screen.py, gossip/partner_check.py."""

from __future__ import annotations

import math

import torch

from swarm_node.errors import PeerRefused, ProtocolError
from swarm_node.wire.activations import decode_activations
from swarm_node.wire.boundary import BoundaryCodec, check_gradient
from swarm_node.wire.frames import FrameLimits, checked_floats, decode_frame, encode_frame, finite

# Control frames: a header and no tensors (proposals, outer fetches and verdicts, refusals)
CONTROL_MAX_BYTES = 4096
CONTROL_LIMITS = FrameLimits(max_header_bytes=CONTROL_MAX_BYTES, max_payload_bytes=0, max_tensors=0)
STATUS_REQUEST = encode_frame({"kind": "status"})
STATUS_REPLY_MAX_BYTES = 64 << 10
MAX_DEADLINE_S = 3600


def rms(t: torch.Tensor) -> float:
    return float(t.float().pow(2).mean().sqrt()) if t.numel() else 0.0


def check_forward_request(header: dict, tensors: list[torch.Tensor], *, spec_hash: str, hidden_size: int,
                          max_batch: int, max_seq: int, vocab_size: int, default_deadline_s: float,
                          codec: str = "fp16") -> tuple[float, torch.Tensor, torch.Tensor]:
    """``/swarm-node/forward``: (deadline in s, activations as fp32, target ids as int64)."""
    if header.get("kind") != "fwd" or header.get("spec") != spec_hash:
        raise ProtocolError("not a forward request of this run")
    deadline = header.get("deadline_s", default_deadline_s)
    if type(deadline) not in (int, float) or not 0 < deadline <= MAX_DEADLINE_S:
        raise ProtocolError(f"bad deadline {deadline!r}")
    if len(tensors) < 2:
        raise ProtocolError("forward request needs activations and targets")
    targets = tensors[-1]
    batch, seq = targets.shape if targets.dim() == 2 else (-1, -1)
    if not 0 < batch <= max_batch or not 0 < seq <= max_seq or targets.dtype not in (torch.int32,
                                                                                     torch.int64):
        raise ProtocolError(f"targets of shape {tuple(targets.shape)} do not fit this stage")
    try:
        hidden = decode_activations(tensors[:-1], (batch, seq, hidden_size), codec)
    except ProtocolError as exc:
        raise ProtocolError(f"activations do not fit this stage: {exc}") from None
    if not finite(hidden):
        raise ProtocolError("non-finite activations")
    if int(targets.min()) < 0 or int(targets.max()) >= vocab_size:
        raise ProtocolError("target ids out of the vocabulary")
    return float(deadline), hidden, targets.long()


def decode_gradient_answer(raw: bytes, limits: FrameLimits, shape: torch.Size,
                           codec: str | BoundaryCodec = "fp16") -> tuple[torch.Tensor, float]:
    """A next-stage peer's answer to our forward request: (gradient wrt the activations
    we sent, or wrt the code of a coded boundary, its loss). A refusal raises
    PeerRefused; anything malformed ProtocolError."""
    header, tensors = decode_frame(raw, limits)
    if not header.get("ok"):
        raise PeerRefused(str(header.get("error", "refused"))[:200])
    if isinstance(codec, BoundaryCodec):
        grad = check_gradient(tensors, tuple(shape), codec)
    else:
        grad = _decoded_gradient(tensors, shape, codec)
    loss = header.get("loss")
    if type(loss) not in (int, float) or not math.isfinite(loss):
        raise ProtocolError(f"bad loss {str(loss)[:40]!r}")
    return grad, float(loss)


def _decoded_gradient(tensors: list[torch.Tensor], shape: torch.Size, codec: str) -> torch.Tensor:
    try:
        grad = decode_activations(tensors, tuple(shape), codec)
    except ProtocolError:
        raise ProtocolError("gradient does not match the activations sent") from None
    if not finite(grad):
        raise ProtocolError("non-finite gradient")
    return grad


PAIR_KINDS = ("propose", "withdraw")


def check_pair_request(raw: bytes, spec_hash: str) -> tuple[str, int | None]:
    """``/swarm-node/pair``: a few bytes asking to pair this round (``propose``) or taking
    back a proposal its sender will not follow with its payload (``withdraw``). Returns
    the kind and the round the sender says it is in (None if it says none)."""
    header, tensors = decode_frame(raw, CONTROL_LIMITS)
    if header.get("kind") not in PAIR_KINDS or header.get("spec") != spec_hash or tensors:
        raise ProtocolError("not a pairing request of this run")
    round_no = header.get("round")
    if round_no is not None and (type(round_no) is not int or round_no < 0):
        raise ProtocolError("a pairing request's round must be a whole number")
    return header["kind"], round_no


OUTER_PARTS = ("delta", "phi")  # a pair's payload moves as two parts, Delta ahead of phi (ALGORITHM.md 3.1)


def check_fetch(raw: bytes, spec_hash: str) -> str | None:
    """``/swarm-node/outer-fetch``: a few bytes asking for the partner's (phi, Delta), or
    for one part of it; returns the part asked for (None: the whole payload)."""
    header = _check_control(raw, "outer-fetch", spec_hash, "not an outer fetch of this run")
    return outer_part(header)


def outer_part(header: dict) -> str | None:
    """The part an outer message names: "delta", "phi", or None for the whole payload."""
    part = header.get("part")
    if part is not None and part not in OUTER_PARTS:
        raise ProtocolError(f"unknown outer payload part {str(part)[:20]!r}")
    return part


def _check_control(raw: bytes, kind: str, spec_hash: str, what: str) -> dict:
    header, tensors = decode_frame(raw, CONTROL_LIMITS)
    if header.get("kind") != kind or header.get("spec") != spec_hash or tensors:
        raise ProtocolError(what)
    return header


MAX_SEEKER_HINTS = 3  # peers a refusal may name as seeking (gossip/seekers.py)
MAX_PEER_ID_CHARS = 64  # base58 libp2p ids are 46-53 characters


MAX_READY_IN_S = 600.0  # the furthest a refusal may say it will accept


def refusal(why: str, seekers: list[str] | tuple[str, ...] = (), ready_in_s: float | None = None) -> bytes:
    """A proposal refused, naming up to MAX_SEEKER_HINTS peers we saw seeking and, for a
    ``not-ready``, in how many seconds we will accept (older nodes read ``ok`` and
    ``error`` only, and ignore the rest)."""
    header = {"ok": False, "error": why}
    if seekers:
        header["seekers"] = list(seekers[:MAX_SEEKER_HINTS])
    if ready_in_s is not None:
        header["ready_in_s"] = round(min(max(ready_in_s, 0.0), MAX_READY_IN_S), 3)
    return encode_frame(header)


def refusal_ready_in_s(raw: bytes) -> float | None:
    """In how many seconds a refuser says it will accept a proposal (None: it did not
    say), or ProtocolError (not a number from 0 to MAX_READY_IN_S)."""
    header, _ = decode_frame(raw, CONTROL_LIMITS)
    ready_in_s = header.get("ready_in_s")
    if ready_in_s is None:
        return None
    if (type(ready_in_s) not in (int, float) or not math.isfinite(ready_in_s)
            or not 0.0 <= ready_in_s <= MAX_READY_IN_S):
        raise ProtocolError(f"a refusal says it is ready in {str(ready_in_s)[:40]!r} seconds")
    return float(ready_in_s)


def refusal_hints(raw: bytes) -> list[str]:
    """The peers a refusal names as seeking, or ProtocolError (a list of at most
    MAX_SEEKER_HINTS peer ids, ASCII letters and digits; none: an empty list)."""
    header, _ = decode_frame(raw, CONTROL_LIMITS)
    hints = header.get("seekers", [])
    if not isinstance(hints, list) or len(hints) > MAX_SEEKER_HINTS:
        raise ProtocolError(f"a refusal names seekers as {type(hints).__name__} of {_length(hints)}")
    for hint in hints:
        if (not isinstance(hint, str) or not 0 < len(hint) <= MAX_PEER_ID_CHARS or not hint.isascii()
                or not hint.isalnum()):
            raise ProtocolError(f"a refusal names a seeker that is no peer id: {str(hint)[:40]!r}")
    return hints


def _length(value: object) -> str:
    return str(len(value)) if isinstance(value, (list, str, dict, bytes)) else "?"


def answer_is_yes(raw: bytes) -> tuple[bool, str]:
    """A control answer (to a proposal, to an outer payload): (yes, the refusal's reason)."""
    header, _ = decode_frame(raw, CONTROL_LIMITS)
    return bool(header.get("ok")), str(header.get("error", "refused"))[:200]


def check_outer_header(header: dict, spec_hash: str, part: str | None = None) -> None:
    """``/swarm-node/outer``: the header of a (phi, Delta) payload, or of the ``part`` of
    it expected, either way."""
    if header.get("kind") != "outer" or header.get("spec") != spec_hash:
        raise ProtocolError("not an outer exchange of this run")
    if outer_part(header) != part:
        raise ProtocolError(
            f"expected the outer payload's {part or 'whole'}, got {header.get('part') or 'whole'}"
        )


MAX_STEP = 10**12


def outer_steps(header: dict) -> tuple[int, int] | None:
    """The inner steps an outer payload's Delta covers, as its sender claims them:
    (first, last), from its last outer step to this round's boundary; None when it does
    not say. ProtocolError for anything but whole numbers 0 <= first <= last < MAX_STEP."""
    steps = header.get("steps")
    if steps is None:
        return None
    if (not isinstance(steps, list) or len(steps) != 2 or not all(type(s) is int for s in steps)
            or not 0 <= steps[0] <= steps[1] < MAX_STEP):
        raise ProtocolError(f"the steps an outer Delta covers are not two step numbers: {str(steps)[:60]}")
    return steps[0], steps[1]


def check_state_chunk(meta: dict, chunk: int, snap_id: str | None) -> tuple[str, int]:
    """``/swarm-node/state``: one chunk's numbering; (snapshot id, number of chunks)."""
    snapshot, num_chunks = meta.get("snapshot"), meta.get("num_chunks")
    if not isinstance(snapshot, str) or len(snapshot) > 64 or (snap_id is not None and snapshot != snap_id):
        raise ProtocolError("the donor changed or garbled the snapshot id")
    if type(num_chunks) is not int or not 0 < num_chunks <= 100_000 or meta.get("chunk") != chunk:
        raise ProtocolError(f"bad chunk numbering from the donor ({meta.get('chunk')!r} of {num_chunks!r})")
    return snapshot, num_chunks


def check_state_counters(meta: dict) -> tuple[int, int, int]:
    """A donor's (inner step, outer round, step of its last round)."""
    counters = [meta.get(k) for k in ("inner_step", "outer_round", "last_round_step")]
    if not all(type(c) is int and 0 <= c < 10**12 for c in counters):
        raise ProtocolError(f"bad counters in the donor's state: {counters}")
    return counters[0], counters[1], counters[2]


MAX_SKETCH_SEED = 1 << 62


def check_sketch_request(header: dict, spec_hash: str, buckets: int) -> int:
    """``/swarm-node/state-sketch``: the seed a joiner asks our sketch under."""
    if header.get("kind") != "sketch" or header.get("spec") != spec_hash:
        raise ProtocolError("not a sketch request of this run")
    seed = header.get("seed")
    if type(seed) is not int or not 0 <= seed < MAX_SKETCH_SEED or header.get("buckets") != buckets:
        raise ProtocolError(f"bad sketch request (seed {seed!r}, buckets {header.get('buckets')!r})")
    return seed


def check_sketch_answer(meta: dict, tensors: list[torch.Tensor], num_tensors: int,
                        buckets: int) -> tuple[tuple[int, int, int], torch.Tensor, torch.Tensor | None]:
    """A witness's sketch: its (inner step, outer round, steps in its round), its rows
    (3, tensors, buckets) and its partners' spread per tensor (None: no partner yet)."""
    counters = [meta.get(k) for k in ("inner_step", "outer_round", "round_steps")]
    if not all(type(c) is int and 0 <= c < 10**12 for c in counters):
        raise ProtocolError(f"bad counters in a sketch: {counters}")
    if len(tensors) not in (1, 2):
        raise ProtocolError(f"a sketch holds 1 or 2 tensors, got {len(tensors)}")
    rows = checked_floats(tensors[0], (3, num_tensors, buckets))
    spread = checked_floats(tensors[1], (num_tensors,)) if len(tensors) == 2 else None
    if not finite(rows) or (spread is not None and (not finite(spread) or bool((spread < 0).any()))):
        raise ProtocolError("non-finite values or a negative distance in a sketch")
    return (counters[0], counters[1], counters[2]), rows, spread

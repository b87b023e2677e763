"""Shared pieces of the property-based fuzz tests of every wire decoder and protocol
handler (tests/unit/test_fuzz_*.py, tests/inproc/test_fuzz_*.py): deterministic
hypothesis settings, and strategies for what a hostile peer sends: any bytes, a valid
frame mutated, or a frame that parses with its fields and tensors bent.

The property throughout: an input decodes to something that passes the checks a valid
input passes, or raises the project's typed error; a handler answers or closes, never
raises, and counts the sender's fault."""

from __future__ import annotations

import msgpack
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from swarm_node.wire.frames import DTYPES, encode_frame

# No example database, and the same examples on every run: CI sees what a developer saw.
FUZZ = {"deadline": None, "derandomize": True, "database": None, "print_blob": False,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                  HealthCheck.data_too_large, HealthCheck.filter_too_much]}


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, **FUZZ)


# Any value msgpack carries, nested a little (what a header field may hold).
scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
           | st.binary(max_size=20))
junk = st.recursive(scalars,
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids,
                                                                              max_size=3), max_leaves=8)
# Numbers near the edges a check must hold: NaN, infinities, zero, huge, negative.
edgy_numbers = st.sampled_from([float("nan"), float("inf"), -float("inf"), 0, -0.0, -1, 1e300, 2**63,
                                2**64 - 1,
                                -2**63, 0.5, True, False])


@st.composite
def bent_map(draw, valid: dict, extra_values=junk) -> dict:
    """``valid`` with some fields replaced by junk or edge values, some dropped, maybe one added."""
    out = dict(valid)
    for key in draw(st.lists(st.sampled_from(sorted(valid) or ["x"]), max_size=3, unique=True)):
        choice = draw(st.integers(0, 2))
        if choice == 0:
            out.pop(key, None)
        else:
            out[key] = draw(extra_values if choice == 1 else edgy_numbers)
    if draw(st.booleans()):
        out[draw(st.text(max_size=8))] = draw(extra_values)
    return out


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """``data`` with bytes flipped, cut, inserted, or its length prefix rewritten."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        choice = draw(st.integers(0, 3))
        if choice == 0 and out:
            out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
        elif choice == 1:
            del out[draw(st.integers(0, len(out))):]
        elif choice == 2:
            at = draw(st.integers(0, len(out)))
            out[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif len(out) >= 4:
            out[0:4] = draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little")
    return bytes(out)


@st.composite
def bent_tensors(draw, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with shapes nudged, dtypes swapped, values made extreme, some dropped or added."""
    out = []
    for t in tensors:
        shape = list(t.shape)
        if draw(st.integers(0, 3)) == 0:
            shape = [max(0, d + draw(st.integers(-2, 2))) for d in shape] or [1]
            if draw(st.booleans()):
                shape = shape[:-1] if len(shape) > 1 else shape + [1]
        dtype = draw(st.sampled_from([t.dtype, t.dtype, *DTYPES.values()]))
        if dtype.is_floating_point:
            fill = draw(st.sampled_from([0.0, 1.0, -1.0, 1e30, float("nan"), float("inf"), 65504.0]))
            value = torch.full(shape, fill).to(dtype)  # 1e30 as fp16 is infinite, as a peer may send
        else:  # out of a narrow dtype's range wraps, as bytes on the wire would
            fill = draw(st.sampled_from([0, 1, -1, 255, 2**31 - 1]))
            value = torch.full(shape, fill, dtype=torch.int64).to(dtype)
        out.append(t.clone() if draw(st.integers(0, 2)) == 0 and list(t.shape) == shape and dtype == t.dtype
                   else value)
    if out and draw(st.integers(0, 4)) == 0:
        del out[draw(st.integers(0, len(out) - 1))]
    if draw(st.integers(0, 4)) == 0:
        out.append(torch.zeros(draw(st.integers(0, 8)), dtype=draw(st.sampled_from(list(DTYPES.values())))))
    return out


def frame_of(header: dict, tensors: list[torch.Tensor]) -> bytes:
    """A frame of ``header`` and ``tensors``, whatever the header holds (a header the
    encoder refuses, with reserved keys, is packed by hand)."""
    try:
        return encode_frame(header, tensors)
    except (TypeError, ValueError, OverflowError):
        head = msgpack.packb({"v": 1, **header, "tensors": header.get("tensors", [])}, use_bin_type=True,
                             default=repr)
        return len(head).to_bytes(4, "little") + head


def frames(header: dict, tensors: list[torch.Tensor] = (), *,
           any_bytes: int = 300) -> st.SearchStrategy[bytes]:
    """What a hostile peer sends where ``header`` and ``tensors`` belong: random bytes, the
    valid frame mutated, the valid frame with its fields and tensors bent, or the valid
    frame itself. ``header`` may be a decoded one (its version is dropped)."""
    header = {k: v for k, v in header.items() if k != "v"}
    tensors = list(tensors)
    valid = encode_frame(header, tensors)
    bent = st.builds(frame_of, bent_map(header), bent_tensors(tensors) if tensors else st.just([]))
    return st.one_of(st.binary(max_size=any_bytes), mutated(valid), bent, st.just(valid))

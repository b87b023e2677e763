"""The blockwise codec: round trips within half a step of each block's scale, for any
values, shapes and both code widths; anything inconsistent a peer could send is a
ProtocolError before anything is allocated; error feedback does not let the error of
a repeated increment accumulate."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_node.errors import ProtocolError
from swarm_node.wire.blockwise import BLOCK, ErrorFeedback, Quantized, dequantize, quantize

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(finite, min_size=0, max_size=700), bits=st.sampled_from([8, 4]),
       rows=st.sampled_from([1, 2, 5]))
def test_round_trips_within_half_a_step_of_the_blocks_scale(values, bits, rows):
    usable = len(values) - len(values) % rows
    t = torch.tensor(values[:usable], dtype=torch.float32).view(rows, -1) if usable else torch.zeros(rows, 0)
    q = quantize(t, bits)
    back = dequantize(q)
    assert back.shape == t.shape
    flat, err = t.flatten(), (back - t).abs().flatten()
    for b in range(math.ceil(flat.numel() / BLOCK)):
        block = slice(b * BLOCK, (b + 1) * BLOCK)
        step = q.scales[b].item()
        assert err[block].max().item() <= step / 2 + 1e-6 * flat[block].abs().max().item() + 1e-30
    assert q.nbytes <= flat.numel() * bits / 8 + 1 + 4 * math.ceil(flat.numel() / BLOCK)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_anything_inconsistent_is_a_protocol_error(data):
    numel = data.draw(st.integers(0, 600))
    bits = data.draw(st.sampled_from([8, 4, 2, 16]))
    codes = torch.tensor(data.draw(st.lists(st.integers(0, 255), max_size=700)), dtype=torch.uint8)
    scales = torch.tensor(data.draw(st.lists(st.floats(width=32), max_size=5)), dtype=torch.float32)
    shape = data.draw(st.sampled_from([(numel,), (numel, 1), (-1,), (numel, -2)]))
    try:
        out = dequantize(Quantized(codes, scales, shape, bits))
    except ProtocolError:
        return
    assert out.shape == shape and torch.isfinite(out).all()


def test_wrong_dtypes_huge_shapes_and_bad_scales_are_refused():
    good = quantize(torch.randn(300))
    for bad in (Quantized(good.codes.to(torch.int32), good.scales, good.shape, 8),
                Quantized(good.codes, good.scales.half(), good.shape, 8),
                Quantized(good.codes, -good.scales, good.shape, 8),
                Quantized(good.codes, good.scales, (1 << 40,), 8),
                Quantized(good.codes, good.scales, (301,), 8),
                Quantized(good.codes[:-1], good.scales, good.shape, 8)):
        with pytest.raises(ProtocolError):
            dequantize(bad)


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_keeps_the_sum_of_repeated_increments(bits):
    g = torch.Generator().manual_seed(0)
    feedback = ErrorFeedback(bits)
    increments = [torch.randn(1000, generator=g) * 1e-3 for _ in range(50)]
    sent = sum(dequantize(feedback.compress([inc])[0]) for inc in increments)
    plain = sum(dequantize(quantize(inc, bits)) for inc in increments)
    truth = sum(increments)
    with_feedback, without = (sent - truth).norm().item(), (plain - truth).norm().item()
    assert with_feedback <= (feedback.residual[0]).norm().item() + 1e-6  # only the last round's remainder
    assert with_feedback < 0.2 * without

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
from swarm_node.wire.blockwise import (
    BLOCK,
    ErrorFeedback,
    Quantized,
    dequantize,
    dequantize_near,
    packed_bytes,
    quantize,
    quantize_near,
)

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(finite, min_size=0, max_size=700), bits=st.sampled_from([8, 4, 3, 2]),
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
    assert q.codes.numel() == packed_bytes(flat.numel(), bits)
    assert q.nbytes <= flat.numel() * bits / 8 + 3 + 4 * math.ceil(flat.numel() / BLOCK)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_anything_inconsistent_is_a_protocol_error(data):
    numel = data.draw(st.integers(0, 600))
    bits = data.draw(st.sampled_from([8, 4, 2, 3, 16]))
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


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_error_feedback_keeps_the_sum_of_repeated_increments(bits):
    g = torch.Generator().manual_seed(0)
    feedback = ErrorFeedback(bits)
    increments = [torch.randn(1000, generator=g) * 1e-3 for _ in range(200)]
    sent = 0
    for inc in increments:
        sent = sent + dequantize(feedback.compress([inc])[0])
        feedback.commit()
    plain = sum(dequantize(quantize(inc, bits)) for inc in increments)
    truth = sum(increments)
    with_feedback, without = (sent - truth).norm().item(), (plain - truth).norm().item()
    assert with_feedback <= (feedback.residual[0]).norm().item() + 1e-6  # only the last round's remainder
    assert with_feedback < 0.2 * without


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(min_value=-1.0, max_value=1.0, width=32), min_size=1, max_size=700),
       bits=st.sampled_from([8, 4, 3, 2]), gap=st.floats(min_value=1e-6, max_value=1e-2), data=st.data())
def test_coded_near_a_receiver_within_twice_the_gap_round_trips_within_half_a_step(values, bits, gap, data):
    x = torch.tensor(values, dtype=torch.float32)
    offsets = data.draw(st.lists(st.floats(min_value=-1.95, max_value=1.95), min_size=len(values),
                                 max_size=len(values)))
    receiver = x + torch.tensor(offsets, dtype=torch.float32) * gap
    gaps = torch.full((-(-len(values) // BLOCK),), gap)
    q = quantize_near(x, bits, gaps)
    step = q.scales[0].item()
    assert packed_bytes(len(values), bits) == q.codes.numel() <= len(values) * bits / 8 + 3
    assert (dequantize_near(q, receiver) - x).abs().max().item() <= step / 2 + 1e-6 * step + 1e-7


@settings(max_examples=200, deadline=None)
@given(data=st.data(), bits=st.sampled_from([8, 4, 3, 2]))
def test_whatever_is_sent_near_us_decodes_within_reach_of_our_own_values(data, bits):
    numel = data.draw(st.integers(1, 600))
    codes = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=packed_bytes(numel, bits),
                                            max_size=packed_bytes(numel, bits))), dtype=torch.uint8)
    steps = torch.tensor(data.draw(st.lists(st.floats(min_value=2**-30, max_value=1024.0, width=32),
                                            min_size=-(-numel // BLOCK), max_size=-(-numel // BLOCK))))
    ours = torch.randn(numel)
    back = dequantize_near(Quantized(codes, steps, (numel,), bits), ours)
    reach = torch.repeat_interleave(steps, BLOCK)[:numel] * 2 ** (bits - 1)
    assert ((back - ours).abs() <= reach * (1 + 1e-6) + 1e-6).all()


def test_a_near_code_with_no_positive_step_or_another_shape_is_refused():
    q = quantize_near(torch.randn(300), 4, torch.full((2,), 1e-3))
    for bad, ours in ((Quantized(q.codes, q.scales * 0, q.shape, 4), torch.zeros(300)),
                      (Quantized(q.codes, q.scales * float("nan"), q.shape, 4), torch.zeros(300)),
                      (q, torch.zeros(301)), (q, torch.zeros(3, 100))):
        with pytest.raises(ProtocolError):
            dequantize_near(bad, ours)

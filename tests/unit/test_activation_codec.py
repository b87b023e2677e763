"""Activations and their gradients in the run's activation_codec (wire/messages.py): int8
round-trips within half a step of each block, a forward request decodes to what was
sent, and anything that does not fit the stage is a ProtocolError before anything is
allocated."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_node.cli.args import ACTIVATION_CODEC_NAMES
from swarm_node.errors import ConfigError, ProtocolError
from swarm_node.spec import RunSpec
from swarm_node.wire.activations import ACTIVATION_CODECS, decode_activations, encode_activations
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.messages import check_forward_request, decode_gradient_answer

HIDDEN = 16
CHECK = dict(spec_hash="s", hidden_size=HIDDEN, max_batch=8, max_seq=32, vocab_size=50,
             default_deadline_s=30.0)


def forward_frame(hidden: torch.Tensor, targets: torch.Tensor, codec: str) -> tuple[dict, list[torch.Tensor]]:
    raw = encode_frame({"kind": "fwd", "spec": "s", "deadline_s": 5.0},
                       [*encode_activations(hidden, codec), targets.to(torch.int32)])
    return decode_frame(raw)


@pytest.mark.parametrize("codec", ACTIVATION_CODECS)
def test_a_forward_request_and_its_answer_decode_to_what_was_sent(codec):
    g = torch.Generator().manual_seed(0)
    hidden, targets = torch.randn(4, 32, HIDDEN, generator=g), torch.randint(0, 50, (4, 32), generator=g)
    _, got, got_targets = check_forward_request(*forward_frame(hidden, targets, codec), codec=codec, **CHECK)
    largest = hidden.abs().max().item()  # int8: half a step of the block's largest value over 127
    tolerance = {"fp32": 0, "fp16": largest * 2 ** -11, "bf16": largest * 2 ** -8,
                 "int8": largest / 127 / 2}[codec]
    assert got.dtype == torch.float32 and got_targets.equal(targets)
    assert (got - hidden).abs().max() <= tolerance * 1.001 + 1e-6
    answer = encode_frame({"ok": True, "loss": 1.5}, encode_activations(hidden, codec))
    grad, loss = decode_gradient_answer(answer, FrameLimits(), hidden.shape, codec)
    assert (
        grad.shape == hidden.shape and loss == 1.5 and (grad - hidden).abs().max() <= tolerance * 1.001 + 1e-6
    )


@settings(max_examples=200, deadline=None)
@given(exponent=st.integers(-120, 120), seed=st.integers(0, 2 ** 31 - 1))
def test_fp16_keeps_its_precision_at_any_scale_a_float32_reaches(exponent, seed):
    """Plain fp16 ends at 65504 and its normals at 6.1e-5; the scale it travels with
    makes the error relative to the tensor's largest value wherever that lies."""
    sent = torch.randn(3, 5, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 2.0 ** exponent
    got = decode_activations(encode_activations(sent, "fp16"), tuple(sent.shape), "fp16")
    assert got.isfinite().all() and (got - sent).abs().max() <= sent.abs().max() * 2 ** -11


@pytest.mark.parametrize("shift", [torch.tensor([127], dtype=torch.int32), torch.tensor([3],
                                                                                        dtype=torch.int64),
                                   torch.tensor([[3]], dtype=torch.int32), torch.tensor([3.0])])
def test_an_fp16_scale_that_is_not_one_int32_in_range_is_a_protocol_error(shift):
    with pytest.raises(ProtocolError, match="fp16 scale"):
        decode_activations([torch.zeros(2, 3, dtype=torch.float16), shift], (2, 3), "fp16")


def test_the_command_line_offers_exactly_the_activation_codecs_there_are():
    assert ACTIVATION_CODEC_NAMES == ACTIVATION_CODECS


def test_int8_activations_send_about_half_the_bytes_of_fp16():
    hidden = torch.randn(8, 64, 256)
    int8 = sum(t.numel() * t.element_size() for t in encode_activations(hidden, "int8"))
    assert int8 <= 0.51 * encode_activations(hidden, "fp16")[0].numel() * 2


def test_a_run_spec_names_a_known_activation_codec():
    with pytest.raises(ConfigError, match="activation_codec"):
        RunSpec(activation_codec="int3")
    assert RunSpec(activation_codec="int8").spec_hash() != RunSpec().spec_hash()


@settings(max_examples=300, deadline=None)
@given(codec=st.sampled_from(ACTIVATION_CODECS), data=st.data())
def test_anything_that_does_not_fit_is_a_protocol_error(codec, data):
    shape = (data.draw(st.integers(1, 4)), data.draw(st.integers(1, 8)), HIDDEN)
    tensors = []
    for _ in range(data.draw(st.integers(0, 3))):
        dtype = data.draw(st.sampled_from([torch.uint8, torch.float32, torch.float16, torch.int64]))
        # long flat tensors, or small blocks of up to 3 dimensions: three free dimensions up
        # to 600 once drew a 600**3 int64 tensor (1.7 GB) and made this test the tier's slowest
        dims = data.draw(st.one_of(st.lists(st.integers(0, 600), min_size=1, max_size=1),
                                   st.lists(st.integers(0, 40), min_size=2, max_size=3)))
        tensors.append(torch.zeros(dims, dtype=dtype))
    try:
        out = decode_activations(tensors, shape, codec)
    except ProtocolError:
        return
    assert out.shape == shape and out.dtype == torch.float32

"""What a next-stage peer answers to a forward request is untrusted too: a loss that is
not a finite number is a typed protocol error (it used to raise ValueError/TypeError on
the compute thread and kill the sending node's producer)."""

import pytest
import torch

from swarm_node.errors import ProtocolError
from swarm_node.wire.activations import encode_activations
from swarm_node.wire.frames import FrameLimits, encode_frame
from swarm_node.wire.messages import decode_gradient_answer, rms

LIMITS = FrameLimits(max_payload_bytes=1 << 20)
SHAPE = torch.Size((2, 3, 4))


def answer(**header) -> bytes:
    return encode_frame({"ok": True, **header}, encode_activations(torch.ones(SHAPE), "fp16"))


@pytest.mark.parametrize("loss", ["2.5", None, float("nan"), float("inf"), [1.0], {"a": 1}, True])
def test_a_loss_that_is_not_a_finite_number_is_a_protocol_error(loss):
    with pytest.raises(ProtocolError, match="bad loss"):
        decode_gradient_answer(answer(loss=loss), LIMITS, SHAPE)


def test_a_missing_loss_is_a_protocol_error_and_a_good_answer_decodes():
    with pytest.raises(ProtocolError):
        decode_gradient_answer(answer(), LIMITS, SHAPE)
    grad, loss = decode_gradient_answer(answer(loss=2), LIMITS, SHAPE)
    assert (
        grad.dtype == torch.float32
        and grad.shape == SHAPE
        and loss == 2.0
        and rms(grad) == pytest.approx(1.0)
    )

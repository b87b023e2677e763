"""The data path's copies between the card and the host (train/host_copy.py), on the card
(`./dev.sh test-gpu`; skipped without CUDA): activations queued to pinned host memory
arrive whole while the compute thread goes on, the card's memory they came from is not
handed out before the copy has read it, and a pinned tensor's way back is queued."""

from __future__ import annotations

import threading

import pytest
import torch

from swarm_node.train.host_copy import pinned_for, to_host
from swarm_node.wire.activations import encode_activations

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def test_a_host_copy_arrives_whole_in_pinned_memory_and_is_waited_for_on_another_thread():
    hidden = torch.randn(8, 1024, 768, device=CUDA)
    for _ in range(20):  # work queued ahead of the copy: it must wait for it
        hidden = hidden * 1.0001
    expected = hidden.to(torch.bfloat16).cpu()
    copy = to_host(encode_activations(hidden, "bf16"))
    del hidden  # the card's memory goes back to the allocator: the copy must still read it right
    scribble = torch.full((8, 1024, 768), 7.0, device=CUDA)  # would take that memory if freed early
    got = []
    waiter = threading.Thread(target=lambda: got.extend(copy.wait()))  # the wire thread's side
    waiter.start()
    waiter.join(30)
    assert len(got) == 1 and got[0].is_pinned() and got[0].device.type == "cpu"
    assert torch.equal(got[0], expected)
    del scribble


def test_int8_codes_and_steps_come_to_the_host_together():
    hidden = torch.randn(4, 256, 512, device=CUDA)
    codes, scales = to_host(encode_activations(hidden, "int8")).wait()
    cpu_codes, cpu_scales = encode_activations(hidden.cpu(), "int8")
    assert torch.equal(codes, cpu_codes) and torch.allclose(scales, cpu_scales)


def test_a_pinned_tensor_goes_to_the_card_without_holding_the_caller():
    t = pinned_for(torch.randn(8, 1024, 768), CUDA)
    assert t.is_pinned()
    on_card = t.to(CUDA, torch.float32, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_card.cpu(), t)
    assert not pinned_for(torch.randn(3), torch.device("cpu")).is_pinned()

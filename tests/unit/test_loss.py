"""The last stage's chunked loss (model/loss.py) against the plain cross-entropy: the same
loss and gradients to rounding, the plain form itself where the logits are small, and
at most one chunk's logits alive at a time."""

import pytest
import torch
from test_memory_estimate import PeakAllocation

from swarm_node.model.config import model_config
from swarm_node.model.loss import head_loss, lm_loss
from swarm_node.model.stages import build_stage

VOCAB, HIDDEN = 300, 16


def _inputs(tokens: int = 37, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, tokens, HIDDEN, generator=gen).requires_grad_(True)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3)
    targets = torch.randint(VOCAB, (1, tokens), generator=gen)
    return hidden, head, targets


def _loss_and_grads(max_logits, autocast: bool = False):
    hidden, head, targets = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = head_loss(hidden, head, targets, max_logits)
    (loss * 3.0).backward()  # the incoming gradient scales both
    return loss.detach(), hidden.grad, head.weight.grad


@pytest.mark.parametrize("chunk_tokens", [1, 5, 36])
def test_chunks_give_the_plain_loss_and_gradients(chunk_tokens):
    plain = _loss_and_grads(None)
    chunked = _loss_and_grads(chunk_tokens * VOCAB)  # 37 tokens: the last chunk is short
    for expected, got in zip(plain, chunked):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_too():
    plain, chunked = _loss_and_grads(None, autocast=True), _loss_and_grads(4 * VOCAB, autocast=True)
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-3, atol=1e-3)
    for expected, got in zip(plain[1:], chunked[1:]):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)


def test_logits_that_fit_take_the_plain_form_bit_for_bit():
    hidden, head, targets = _inputs()
    assert torch.equal(head_loss(hidden, head, targets, 37 * VOCAB), lm_loss(head(hidden), targets))


def test_without_gradients_only_the_loss_is_computed():
    hidden, head, targets = _inputs()
    with torch.no_grad():
        chunked = head_loss(hidden, head, targets, 3 * VOCAB)
        plain = lm_loss(head(hidden), targets)
    assert not chunked.requires_grad
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-6)


def test_a_last_stage_with_chunked_loss_trains_as_the_plain_one():
    config = model_config("debug", vocab_size=VOCAB, max_seq_len=16)
    plain, chunked = (build_stage(config, num_stages=2, stage_index=1, seed=3) for _ in range(2))
    plain.loss_chunk_logits, chunked.loss_chunk_logits = None, 7 * VOCAB
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 16, 64, generator=gen)
    targets = torch.randint(VOCAB, (2, 16), generator=gen)
    torch.testing.assert_close(chunked(hidden, targets), plain(hidden, targets), rtol=1e-5, atol=1e-6)
    plain(hidden, targets).backward()
    chunked(hidden, targets).backward()
    for (name, a), b in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_at_most_one_chunk_of_logits_is_alive_at_once():
    tokens, vocab = 512, 2048
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(HIDDEN, vocab, bias=False)
    targets = torch.randint(vocab, (1, tokens), generator=gen)
    peaks = {}
    for name, max_logits in (("plain", None), ("chunked", 32 * vocab)):
        hidden = torch.randn(1, tokens, HIDDEN, generator=gen).requires_grad_(True)
        with PeakAllocation([hidden, head.weight, targets]) as peak:
            head_loss(hidden, head, targets, max_logits).backward()
        peaks[name] = peak.peak
    logits_bytes = tokens * vocab * 4
    assert peaks["plain"] > 2 * logits_bytes  # logits and log-probabilities in fp32, then gradients
    # one 32-token chunk's logits (and their gradient), the head's gradient and the hidden one
    assert peaks["chunked"] < 3 * 32 * vocab * 4 + 2 * vocab * HIDDEN * 4 + 2 * tokens * HIDDEN * 4

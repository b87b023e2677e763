"""The last stage's loss: the LM head and cross-entropy, over chunks of tokens when the
logits would be large.

``F.cross_entropy(lm_head(h).float(), targets)`` holds the whole (tokens x vocabulary)
logits several times at its peak: the bf16 logits, their fp32 copy, the saved
log-probabilities and, in the backward, two more fp32 buffers (12-18 bytes a logit; a
micro-batch of 8 x 1024 tokens with a 32k vocabulary: 3-5 GiB). ``head_loss`` computes
the same mean loss chunk by chunk and, in the same pass, the chunk's gradients with
respect to the hidden states and the head's weight, so at most one chunk's logits are
alive at a time and nothing is recomputed. Each chunk runs the operations autocast runs
for the plain form (the matmuls in the autocast dtype, log-softmax in fp32), so the
loss and the gradients equal the plain form's to rounding (tests/unit/test_loss.py).

Every target counts: the data has no padding, so there is no ignore index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Logits alive at once on the last stage: 16M elements, 64 MiB in fp32. Micro-batches
# whose logits fit take the plain form, bit for bit what it always computed.
LOSS_CHUNK_LOGITS = 1 << 24


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, V) logits against (B, T) targets, in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def chunk_tokens(vocab_size: int, max_logits: int | None) -> int | None:
    """Tokens a chunk holds, or None: no chunking."""
    return None if max_logits is None else max(1, max_logits // vocab_size)


def head_loss(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
              max_logits: int | None = LOSS_CHUNK_LOGITS) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` (hidden: (B, T, H), targets: (B, T)); chunked
    when the logits exceed ``max_logits`` elements (None: never)."""
    tokens = targets.numel()
    chunk = chunk_tokens(head.out_features, max_logits)
    if chunk is None or tokens <= chunk:
        return lm_loss(head(hidden), targets)
    return _ChunkedHeadLoss.apply(hidden.reshape(tokens, -1), head.weight, targets.reshape(tokens), chunk)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Loss and gradients in one pass over chunks of tokens; the backward only scales
    the gradients by the loss's incoming gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        # hidden (N, H), weight (V, H), targets (N,). Autocast, when on, stays on in here:
        # F.linear and the gradient matmuls run in its dtype, as they do in the plain form.
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tokens = targets.numel()
        dtype = _matmul_dtype(hidden)
        weight_cast = weight.to(dtype)  # (V, H), cast once as autocast's weight cache does
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden, dtype=torch.float32) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        for start in range(0, tokens, chunk):
            h, t = hidden[start:start + chunk].to(dtype), targets[start:start + chunk]  # (n, H), (n,)
            loss_sum, grad_logits = _chunk(h, t, weight_cast, tokens, want_hidden or want_weight)
            total += loss_sum
            if want_hidden:
                grad_hidden[start:start + chunk] = grad_logits @ weight_cast  # (n, H)
            if want_weight:
                grad_weight += grad_logits.t() @ h  # (V, H)
            del grad_logits  # before the next chunk's logits: one chunk's alive at a time
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total / tokens

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors  # scaled in place: a graph is backpropagated once
        scale = grad_loss.float()
        return (None if grad_hidden is None else grad_hidden.mul_(scale),
                None if grad_weight is None else grad_weight.mul_(scale), None, None)


def _chunk(h: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, tokens: int,
           with_gradient: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's summed loss and, ``with_gradient``, d(mean loss)/d(logits) in the
    matmul dtype, as autocast's cast hands it to the head's backward."""
    log_probs = torch.log_softmax(F.linear(h, weight).float(), dim=-1)  # (n, V) fp32
    loss_sum = -log_probs.gather(1, targets[:, None]).sum()
    if not with_gradient:
        return loss_sum, None
    grad_logits = log_probs.exp_()  # the softmax, in place of the log-probabilities
    del log_probs
    grad_logits[torch.arange(len(targets), device=targets.device), targets] -= 1.0
    return loss_sum, grad_logits.div_(tokens).to(weight.dtype)


def _matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype autocast gives the head's matmuls on this device, else the input's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype

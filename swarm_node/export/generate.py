"""Sampling text from an assembled model (``swarm-node generate``)."""

from __future__ import annotations

import torch

from swarm_node.model.stages import PipelineStage


@torch.no_grad()
def sample(model: PipelineStage, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.8,
           top_k: int = 0, seed: int = 0) -> list[int]:
    """Autoregressive sampling; the context is cut to the model's last max_seq_len tokens
    (there is no KV cache: fine for the small models a CPU runs)."""
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    window = model.config.max_seq_len
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids[-window:]]))[0, -1].float()
        if temperature <= 0:
            ids.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k > 0:
            cutoff = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
    return ids[len(prompt_ids):]

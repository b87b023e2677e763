"""A Llama with the learned stage boundaries of a swarm-node ``bottleneck`` run
(docs/ALGORITHM.md section 9). `swarm-node export` writes this file beside the weights;
load the folder with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``.
It needs only torch and transformers (it imports nothing of swarm-node).

Boundary i sits before decoder layer ``cuts[i]`` (before the final norm when that is the
layer count). There the hidden state h of each token becomes

    decoder_i(encoder_i(h - t_i)) + anchor_i[token]

where t_i is the stream's token part: the input embedding of the token for boundary 0,
``anchor_{i-1}[token]`` after it. That is what the swarm computes across its stage
boundaries, less the wire's rounding of the code: rounding is how the code travels, not a
layer of the model (the swarm's own unsplit model and its evaluation leave it out too).
Every boundary acts on each position alone, so the key-value cache and ``generate`` work
as for a plain Llama; the anchors need the token ids, so the model takes ``input_ids``,
not ``inputs_embeds`` alone.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel


class SwarmBottleneckLlamaConfig(LlamaConfig):
    """A Llama's settings plus ``swarm_boundary``: {"kind": "bottleneck", "width": values a
    token, "cuts": the layer index each boundary sits before}. A type of its own, so that
    no loader takes the folder for a plain Llama and drops the boundaries."""

    model_type = "swarm_bottleneck_llama"


class BottleneckSide(nn.Module):
    """One boundary: the sending stage's encoder, the receiving stage's decoder and anchor."""

    def __init__(self, hidden: int, width: int, vocab_size: int):
        super().__init__()
        self.encoder = nn.Linear(hidden, width, bias=False)
        self.decoder = nn.Linear(width, hidden, bias=False)
        self.anchor = nn.Embedding(vocab_size, hidden)


class SwarmBottleneckLlamaForCausalLM(LlamaForCausalLM):
    """transformers' Llama (its layers, cache, loss and ``generate`` unchanged) with the
    boundaries applied by forward pre-hooks on the layers they sit before. Parameter
    names are the swarm's: ``boundaries.sides.<i>.{encoder,decoder,anchor}.weight``."""

    config_class = SwarmBottleneckLlamaConfig

    def __init__(self, config: SwarmBottleneckLlamaConfig):
        LlamaPreTrainedModel.__init__(self, config)  # LlamaForCausalLM's body, with the boundaries
        self.model = LlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        boundary = dict(getattr(config, "swarm_boundary", None) or {})
        cuts = [int(c) for c in boundary.get("cuts", ())]
        if boundary.get("kind") != "bottleneck" or not cuts or cuts != sorted(set(cuts)) or cuts[0] < 0 \
                or cuts[-1] > config.num_hidden_layers:
            raise ValueError(f"swarm_boundary must name a bottleneck's increasing cuts within the "
                             f"{config.num_hidden_layers} layers, got {boundary!r}")
        self.boundaries = nn.Module()
        self.boundaries.sides = nn.ModuleDict({
            str(i): BottleneckSide(config.hidden_size, int(boundary["width"]), config.vocab_size)
            for i in range(len(cuts))})
        self._token_ids: torch.Tensor | None = None
        self.model.register_forward_pre_hook(self._read_ids, with_kwargs=True)
        self.model.register_forward_hook(self._forget_ids, always_call=True)
        for i, cut in enumerate(cuts):
            before = self.model.layers[cut] if cut < config.num_hidden_layers else self.model.norm
            before.register_forward_pre_hook(functools.partial(self._cross, i), with_kwargs=True)
        self.post_init()

    def _read_ids(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._token_ids = args[0] if args else kwargs.get("input_ids")

    def _forget_ids(self, module: nn.Module, args: tuple, output) -> None:
        self._token_ids = None

    def token_part(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        """What the stream holds of the token's embedding before boundary ``index``."""
        if index == 0:
            return self.model.embed_tokens(ids)
        return self.boundaries.sides[str(index - 1)].anchor(ids)

    def _cross(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = self._token_ids
        if ids is None:
            raise ValueError("a swarm bottleneck model needs input_ids: its boundaries add embeddings of the "
                             "tokens, which inputs_embeds alone do not name")
        hidden = args[0] if args else kwargs["hidden_states"]
        side = self.boundaries.sides[str(index)]
        hidden = side.decoder(side.encoder(hidden - self.token_part(index, ids))) + side.anchor(ids)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

import pytest
import torch

from swarm_node.model import build_model, build_stage, model_config, split_layers
from swarm_node.model.config import NAMED_SIZES


def _chain(stages, inputs, targets):
    hidden = inputs
    for stage in stages:
        hidden = stage(hidden, targets if stage.is_last else None)
    return hidden


@pytest.mark.parametrize("num_stages,layers", [(2, None), (3, None), (3, (0, 3, 1)), (4, (1, 1, 1, 1))])
def test_split_model_computes_exactly_what_the_unsplit_model_computes(num_stages, layers):
    config = model_config("debug", vocab_size=40, max_seq_len=16, num_layers=4)
    full = build_model(config, seed=7)
    stages = [build_stage(config, num_stages=num_stages, stage_index=s, seed=7, layers_per_stage=layers)
              for s in range(num_stages)]
    inputs = torch.randint(0, 40, (3, 16))
    targets = torch.randint(0, 40, (3, 16))
    assert torch.equal(_chain(stages, inputs, None), full(inputs))
    assert torch.equal(_chain(stages, inputs, targets), full(inputs, targets))
    # Parameters line up one to one by name.
    split_params = {n: p for s in stages for n, p in s.named_parameters()}
    assert split_params.keys() == dict(full.named_parameters()).keys()
    assert all(torch.equal(split_params[n], p) for n, p in full.named_parameters())


def test_split_gradients_equal_unsplit_gradients_and_embedding_trains():
    config = model_config("debug", vocab_size=32, max_seq_len=8)
    full = build_model(config, seed=1)
    s0, s1 = (build_stage(config, num_stages=2, stage_index=s, seed=1) for s in range(2))
    inputs, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    full(inputs, targets).backward()
    hidden = s0(inputs)
    boundary = hidden.detach().requires_grad_(True)
    s1(boundary, targets).backward()
    hidden.backward(boundary.grad)
    grads = {n: p.grad for s in (s0, s1) for n, p in s.named_parameters()}
    for name, p in full.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-6), name
    assert grads["model.embed_tokens.weight"].abs().sum() > 0


def test_hugging_face_parameter_names():
    config = model_config("debug", vocab_size=16, max_seq_len=8)
    names = {n for n, _ in build_model(config, seed=0).named_parameters()}
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        expected |= {prefix + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                          "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                          "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                          "mlp.down_proj.weight")}
    assert names == expected


def test_grouped_query_attention_is_causal_and_sized():
    config = model_config("debug", vocab_size=16, max_seq_len=12, num_kv_heads=2)
    model = build_model(config, seed=0)
    assert model.model.layers["0"].self_attn.k_proj.weight.shape == (2 * config.head_dim, config.hidden_size)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()
    a = torch.randint(0, 16, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 16  # change only the future
    assert torch.equal(model(a)[0, :8], model(b)[0, :8])
    assert not torch.equal(model(a)[0, 8:], model(b)[0, 8:])


def test_named_sizes_and_data_driven_shapes():
    assert NAMED_SIZES["small"][:2] == (768, 12)
    assert NAMED_SIZES["medium"][:2] == (2048, 24)
    assert NAMED_SIZES["large"][:2] == (4096, 32)
    tiny = model_config("tiny", vocab_size=256, max_seq_len=256)
    assert 1e6 < tiny.num_parameters() < 1e7
    assert model_config("large", vocab_size=32000, max_seq_len=1024).num_parameters() == pytest.approx(
        6.74e9, rel=0.01
    )
    with pytest.raises(ValueError, match="unknown model size"):
        model_config("huge", vocab_size=1, max_seq_len=1)


def test_split_layers_rules():
    assert split_layers(12, 2) == (range(6), range(6, 12))
    assert split_layers(5, 3) == (range(2), range(2, 4), range(4, 5))
    assert split_layers(4, 2, (0, 4)) == (range(0), range(4))
    with pytest.raises(ValueError):
        split_layers(4, 2, (1, 2))
    with pytest.raises(ValueError):
        split_layers(4, 3, (2, 0, 2))
    with pytest.raises(ValueError):
        split_layers(2, 3)


def test_init_is_deterministic_and_seed_dependent():
    config = model_config("debug", vocab_size=16, max_seq_len=8)
    a, b, c = build_model(config, seed=3), build_model(config, seed=3), build_model(config, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_stage_rejects_bad_inputs():
    config = model_config("debug", vocab_size=16, max_seq_len=8)
    s0 = build_stage(config, num_stages=2, stage_index=0, seed=0)
    with pytest.raises(TypeError):
        s0(torch.zeros(1, 8))
    with pytest.raises(ValueError):
        s0(torch.zeros(1, 9, dtype=torch.long))

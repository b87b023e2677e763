"""Coded stage boundaries in the model (model/boundary.py): the split model computes what
the unsplit one does, gradients included; a subspace model is a plain Llama whose
weights lie in the subspace; every peer of a stage builds the same weights and fixed
tables from the seed, and the fixed tables stay out of checkpoints."""

import pytest
import torch

from swarm_node.model import build_model, build_stage, model_config
from swarm_node.model.boundary import BoundaryConfig, plain_state_dict
from swarm_node.model.stages import stage_cuts

SPLITS = [(2, None), (3, None), (3, (0, 3, 1)), (4, (1, 1, 1, 1)), (2, (4, 0))]


def _config(kind, num_stages, layers, width=5):
    cuts = stage_cuts(4, num_stages, layers)
    return model_config("debug", vocab_size=40, max_seq_len=16, num_layers=4,
                        boundary=BoundaryConfig(kind, width, cuts))


def _chain(stages, inputs, targets, codes=None):
    """The stages one after another, each boundary's code detached as the wire does
    (``codes`` collects (sent, received) per boundary)."""
    hidden = inputs
    for stage in stages:
        if not stage.is_first:
            received = hidden.detach().requires_grad_(True)
            if codes is not None:
                codes.append((hidden, received))
            hidden = received
        hidden = stage(hidden, targets if stage.is_last else None, tokens=inputs)
    return hidden


@pytest.mark.parametrize("kind", ["bottleneck", "subspace"])
@pytest.mark.parametrize("num_stages,layers", SPLITS)
def test_the_split_model_computes_and_learns_what_the_unsplit_model_does(kind, num_stages, layers):
    config = _config(kind, num_stages, layers)
    full = build_model(config, seed=7)
    stages = [build_stage(config, num_stages=num_stages, stage_index=s, seed=7, layers_per_stage=layers)
              for s in range(num_stages)]
    g = torch.Generator().manual_seed(0)
    inputs, targets = torch.randint(0, 40, (3, 16), generator=g), torch.randint(0, 40, (3, 16), generator=g)
    split_params = {n: p for s in stages for n, p in s.named_parameters()}
    assert split_params.keys() == dict(full.named_parameters()).keys()
    assert all(torch.equal(split_params[n], p) for n, p in full.named_parameters())
    codes = []
    loss = _chain(stages, inputs, targets, codes)
    assert codes and all(sent.shape == (3, 16, 5) for sent, _ in codes)
    full_loss = full(inputs, targets)
    assert torch.equal(loss, full_loss)
    full_loss.backward()
    loss.backward()
    for sent, received in reversed(codes):  # gradients back across each boundary, as the wire returns them
        sent.backward(received.grad)
    for name, p in full.named_parameters():
        assert torch.allclose(split_params[name].grad, p.grad, atol=1e-6), name


def test_a_subspace_model_is_a_plain_llama_with_its_weights_multiplied_out():
    config = _config("subspace", 2, None)
    model = build_model(config, seed=3)
    with torch.no_grad():  # trained-looking weights: the coefficients away from their start
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    plain = build_model(model_config("debug", vocab_size=40, max_seq_len=16, num_layers=4), seed=3)
    state = plain_state_dict(model)
    plain.load_state_dict(state, strict=True)
    inputs, targets = torch.randint(0, 40, (2, 16)), torch.randint(0, 40, (2, 16))
    assert torch.allclose(model(inputs, targets), plain(inputs, targets), atol=1e-5)
    # every residual write before the boundary lies in one fixed subspace of width 5
    for i in (0, 1):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            assert torch.linalg.matrix_rank(state[f"model.layers.{i}.{name}"]) == 5
    assert torch.linalg.matrix_rank(state["model.layers.2.self_attn.o_proj.weight"]) == 64


def test_a_subspace_boundary_rebuilds_the_stream_exactly():
    config = _config("subspace", 2, None)
    s0, s1 = (build_stage(config, num_stages=2, stage_index=s, seed=5) for s in range(2))
    with torch.no_grad():
        for p in s0.parameters():
            p.add_(0.1)
    inputs = torch.randint(0, 40, (2, 16))
    stream = s0.model.embed_tokens(inputs) + s0.boundaries.first_token_part(inputs, None)
    for layer in s0.model.layers.values():
        stream = layer(stream, s0.rotary)
    rebuilt, _ = s1.boundaries.rebuild(0, s0(inputs), inputs)
    assert torch.allclose(rebuilt, stream, atol=1e-5)


def test_a_bottleneck_starts_as_the_stream_projected_on_a_seeded_basis():
    config = _config("bottleneck", 2, None)
    s0, s1 = (build_stage(config, num_stages=2, stage_index=s, seed=5) for s in range(2))
    enc, dec = s0.boundaries.sides["0"].encoder.weight, s1.boundaries.sides["0"].decoder.weight
    assert torch.allclose(enc @ enc.t(), torch.eye(5), atol=1e-5) and torch.equal(dec, enc.t())
    assert torch.equal(s1.boundaries.sides["0"].anchor.weight, s0.model.embed_tokens.weight)


@pytest.mark.parametrize("kind", ["bottleneck", "subspace"])
def test_every_peer_of_a_stage_builds_the_same_weights_and_the_tables_stay_out_of_checkpoints(kind):
    config = _config(kind, 2, None)
    for index in (0, 1):
        a, b = (build_stage(config, num_stages=2, stage_index=index, seed=9) for _ in range(2))
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
        assert all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers()))
        persistent = set(a.state_dict())
        named = {n for n, _ in a.named_parameters()}
        assert persistent == named, persistent ^ named
    other = build_stage(config, num_stages=2, stage_index=1, seed=10)
    assert any(not torch.equal(x, y) for x, y in zip(other.parameters(), b.parameters()))


def test_boundaries_that_do_not_cut_the_stages_are_refused():
    config = _config("bottleneck", 2, None)  # cut after layer 2
    with pytest.raises(ValueError, match="do not cut out"):
        build_stage(config, num_stages=2, stage_index=0, seed=0, layers_per_stage=(1, 3))
    with pytest.raises(ValueError, match="token ids"):
        build_stage(config, num_stages=2, stage_index=1, seed=0)(torch.zeros(2, 16, 5))

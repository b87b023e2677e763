import pytest
import torch

from swarm_node.optim import InnerHyper, InnerOptimizer, lr_at
from swarm_node.optim.ddp import average_gradients


def test_schedule_warms_up_then_decays_to_a_tenth():
    h = InnerHyper(lr=1.0, warmup_steps=10, total_steps=110)
    assert lr_at(0, h) == pytest.approx(0.1)
    assert lr_at(9, h) == pytest.approx(1.0)
    assert lr_at(10, h) == pytest.approx(1.0)
    assert lr_at(60, h) == pytest.approx(0.55)
    assert lr_at(110, h) == pytest.approx(0.1)
    assert lr_at(10_000, h) == pytest.approx(0.1)
    assert all(lr_at(s, h) >= lr_at(s + 1, h) for s in range(10, 120))


def test_step_clips_and_follows_its_own_counter():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = InnerOptimizer([p], InnerHyper(lr=0.1, warmup_steps=2, total_steps=10, clip_norm=1.0))
    p.grad = torch.full((4,), 10.0)
    norm = opt.step()
    assert norm == pytest.approx(20.0)
    assert opt.step_count == 1 and p.grad is None
    # Adam's first step moves each coordinate by ~lr regardless of scale; warm-up lr = 0.05.
    assert torch.allclose(p.detach(), torch.full((4,), -0.05), atol=1e-6)
    state = opt.state_dict()
    clone = InnerOptimizer([torch.nn.Parameter(p.detach().clone())], opt.hyper)
    clone.load_state_dict(state)
    assert clone.step_count == 1 and clone.lr == opt.lr


def test_average_gradients_makes_workers_agree():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])
    average_gradients([[a], [b]])
    assert torch.equal(a.grad, torch.full((3,), 2.0)) and torch.equal(b.grad, a.grad)

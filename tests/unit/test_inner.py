import copy

import pytest
import torch

from swarm_node.optim import InnerHyper, InnerOptimizer, lr_at
from swarm_node.optim.ddp import average_gradients
from swarm_node.optim.inner import fused_by_default


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


def _reference_step(reference: torch.optim.AdamW, params: list, hyper: InnerHyper, step: int) -> None:
    torch.nn.utils.clip_grad_norm_(params, hyper.clip_norm, foreach=None)
    for group in reference.param_groups:
        group["lr"] = lr_at(step, hyper)
    reference.step()
    reference.zero_grad(set_to_none=True)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_steps_are_bit_identical_to_torch_adamw_and_the_state_dicts_load_into_each_other(weight_decay):
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (4,), (3, 3)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hyper = InnerHyper(lr=0.05, warmup_steps=3, total_steps=20, weight_decay=weight_decay, clip_norm=2.0)
    optimizer = InnerOptimizer(ours, hyper)
    reference = torch.optim.AdamW(theirs, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps,
                                  weight_decay=weight_decay, foreach=True)

    def both_step(step: int) -> None:
        grads = [torch.randn(s, generator=gen) * 3 for s in shapes]
        if step % 4 == 0:  # the last parameter gets no gradient now and then (from the first step on)
            grads[-1] = None
        for mine, reference_param, grad in zip(ours, theirs, grads):
            mine.grad = None if grad is None else grad.clone()
            reference_param.grad = None if grad is None else grad.clone()
        optimizer.step()
        _reference_step(reference, theirs, hyper, step)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), step

    for step in range(10):
        both_step(step)
    assert set(optimizer.state) == set(reference.state_dict()["state"])
    # torch's state dict loads into ours and ours into torch's: the steps stay identical
    optimizer.load_moments_state_dict(copy.deepcopy(reference.state_dict()))
    reference.load_state_dict(copy.deepcopy(optimizer.moments_state_dict()))  # both hand out live tensors
    for step in range(10, 14):
        both_step(step)


def test_the_fused_kernel_is_taken_on_cuda_only():
    assert fused_by_default(torch.device("cuda")) and fused_by_default(torch.device("cuda:1"))
    assert not fused_by_default(torch.device("cpu")) and not fused_by_default(torch.device("mps"))
    # the CPU: bit-exact path
    assert not InnerOptimizer([torch.nn.Parameter(torch.zeros(2))], InnerHyper()).fused


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_fused_kernel_steps_as_the_foreach_path_does_to_fp32_rounding(weight_decay):
    """torch has the fused AdamW kernel on the CPU too: the CUDA path's update, checked here."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(16, 8), (8,), (5, 3)]
    foreach = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    fused = [torch.nn.Parameter(p.detach().clone()) for p in foreach]
    hyper = InnerHyper(lr=0.05, warmup_steps=3, total_steps=20, weight_decay=weight_decay, clip_norm=2.0)
    reference, candidate = InnerOptimizer(foreach, hyper), InnerOptimizer(fused, hyper, fused=True)
    for step in range(12):
        grads = [torch.randn(s, generator=gen) * 3 for s in shapes]
        if step % 4 == 1:  # a parameter without a gradient keeps its moments and takes no decay
            grads[-1] = None
        for a, b, grad in zip(foreach, fused, grads):
            a.grad = None if grad is None else grad.clone()
            b.grad = None if grad is None else grad.clone()
        assert reference.step() == pytest.approx(candidate.step(), rel=1e-6)
        for a, b in zip(foreach, fused):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    ours, theirs = reference.moments_state_dict(), candidate.moments_state_dict()
    assert ours["param_groups"] == theirs["param_groups"]  # one layout, whichever kernel stepped
    for index, state in ours["state"].items():
        assert torch.equal(state["step"], theirs["state"][index]["step"])
        torch.testing.assert_close(theirs["state"][index]["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-5,
                                   atol=1e-7)


def test_moments_that_do_not_fit_the_parameters_are_refused():
    p = torch.nn.Parameter(torch.zeros(4))
    optimizer = InnerOptimizer([p], InnerHyper())
    moments = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5)}
    with pytest.raises(ValueError, match="shape"):
        optimizer.load_moments_state_dict({"state": {0: moments}})
    with pytest.raises(ValueError, match="parameter 1"):
        optimizer.load_moments_state_dict({"state": {1: {**moments, "exp_avg": torch.zeros(4)}}})
    fitting = {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    for step in (torch.tensor([1.0, 2.0]), torch.tensor(float("nan")), torch.tensor(-1.0)):
        with pytest.raises(ValueError, match="step count"):
            optimizer.load_moments_state_dict({"state": {0: {**fitting, "step": step}}})
    optimizer.load_moments_state_dict({"state": {0: {**fitting, "step": torch.tensor(3.0)}}})
    assert optimizer.state[0]["step"].item() == 3.0


def test_average_gradients_makes_workers_agree():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])
    average_gradients([[a], [b]])
    assert torch.equal(a.grad, torch.full((3,), 2.0)) and torch.equal(b.grad, a.grad)


def _stepped_worker(betas=(0.9, 0.999), steps: int = 3):
    from swarm_node.data.spec import DataSpec
    from swarm_node.optim import default_method
    from swarm_node.spec import RunSpec
    from swarm_node.train.worker import StageWorker

    spec = RunSpec(run_id="moments", model_size="debug", num_stages=1, seq_len=8, batch_size=2,
                   samples_per_step=2,
                   data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=4),
                   inner=InnerHyper(lr=1e-3, warmup_steps=2, total_steps=1000, betas=betas))
    worker = StageWorker(spec, 0, 64, "cpu")
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):  # steps that leave Adam moments behind; the first parameter never has a gradient
        for p in worker.params[1:]:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        worker.inner.step()
    return spec, worker


def test_a_joiner_adopts_its_donors_moments_and_steps_as_it_would():
    """A snapshot carries the inner AdamW's moments (a joiner with fresh ones made Deltas
    2-4x its partners'): the joiner's next step equals its donor's, bit for bit."""
    from swarm_node.train.worker import StageWorker

    spec, donor = _stepped_worker()
    joiner = StageWorker(spec, 0, 64, "cpu")
    snap = donor.snapshot()
    joiner.load_snapshot(snap["inner_step"], snap["outer_round"], snap["tensors"])
    assert 0 not in joiner.inner.state and set(joiner.inner.state) == set(donor.inner.state)
    grads = [torch.randn_like(p) * 1e-3 for p in donor.params]
    for worker in (donor, joiner):
        for p, grad in zip(worker.params, grads):
            p.grad = grad.clone()
        worker.inner.step()
    assert all(torch.equal(a, b) for a, b in zip(donor.params, joiner.params))


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95), (0.5, 0.99)])
def test_moments_any_adam_makes_pass_and_forged_ones_are_refused(betas):
    """|exp_avg| <= sqrt(C exp_avg_sq) holds for any gradients (optim/inner.py
    moment_bound): held here for gradients built to approach it (one large gradient
    then quiet ones, a constant sign), and moments forged to make a joiner's steps large
    fail it, as do negative or non-finite values and step counts that are negative or
    not whole."""
    spec, worker = _stepped_worker(betas)
    inner = worker.inner
    for scale in (1.0, 1e-6, 1e3):  # a sign that stays, a spike, then near-silence: m close to its bound
        for p in worker.params[1:]:
            p.grad = torch.full_like(p, scale)
        inner.step()
    moments = inner.moment_tensors()
    assert inner.moments_problem(moments) is None
    n = len(worker.params)

    def forged(index: int, change) -> list[torch.Tensor]:
        out = [t.clone() for t in moments]
        out[index] = change(out[index])
        return out

    assert "bound" in inner.moments_problem(forged(1, lambda m: m + 10 * m.abs().max() + 1))
    assert "negative" in inner.moments_problem(forged(n + 1, lambda v: -v - 1))
    assert "non-finite" in inner.moments_problem(forged(n + 1, lambda v: v * float("nan")))
    assert "step counts" in inner.moments_problem(forged(2 * n, lambda s: s + 0.5))
    assert "step counts" in inner.moments_problem(forged(2 * n, lambda s: s - 1e6))
    assert inner.moments_problem(forged(2 * n, lambda s: s + 1e6)) is None  # more steps than ours: a joiner's
    assert "tensors" in inner.moments_problem(moments[:-1])


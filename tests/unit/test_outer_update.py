"""The outer step against hand-computed values, ALGORITHM.md section 3 written out
independently, and its special cases."""

import math

import pytest
import torch

from swarm_node.optim import OuterHyper, SlowWeights, group_mean, outer_update

NOLOCO = dict(alpha=0.5, beta=0.7, gamma=0.7)


def spec_update(phi, momentum, group_phi, group_delta, alpha, beta, gamma):
    """ALGORITHM.md section 3, element by element in float64."""
    n = len(group_phi)
    mean_delta = sum(d.double() for d in group_delta) / n
    mean_phi = sum(p.double() for p in group_phi) / n
    gamma_term = gamma * (phi.double() - mean_phi) if n > 1 else 0.0
    new_m = alpha * momentum.double() + beta * mean_delta - gamma_term
    return phi.double() + new_m, new_m


def test_hand_computed_pair():
    phi, m = torch.tensor([1.0, -2.0]), torch.tensor([0.1, 0.0])
    other_phi = torch.tensor([3.0, 0.0])
    my_delta, other_delta = torch.tensor([0.2, 0.4]), torch.tensor([-0.2, 0.0])
    new_phi, new_m = outer_update(phi, m, [phi, other_phi], [my_delta, other_delta], **NOLOCO)
    # mean delta = [0, 0.2]; mean phi = [2, -1]; phi - mean = [-1, -1]
    # m' = 0.5*[0.1, 0] + 0.7*[0, 0.2] - 0.7*[-1, -1] = [0.75, 0.84]
    assert new_m.tolist() == pytest.approx([0.75, 0.84], abs=1e-6)
    assert new_phi.tolist() == pytest.approx([1.75, -1.16], abs=1e-6)


def test_hand_computed_local_only_ignores_gamma():
    phi, m, d = torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([0.3])
    new_phi, new_m = outer_update(phi, m, [phi], [d], alpha=0.5, beta=0.7, gamma=123.0)
    assert new_m.item() == pytest.approx(0.5 * 0.5 + 0.7 * 0.3)
    assert new_phi.item() == pytest.approx(1.0 + 0.46)


@pytest.mark.parametrize("group_size", [1, 2, 5])
def test_matches_spec_on_random_tensors(group_size, gen):
    shape = (17, 33)
    group_phi = [torch.randn(shape, generator=gen) for _ in range(group_size)]
    group_delta = [0.01 * torch.randn(shape, generator=gen) for _ in range(group_size)]
    momentum = 0.01 * torch.randn(shape, generator=gen)
    new_phi, new_m = outer_update(group_phi[0], momentum, group_phi, group_delta, **NOLOCO)
    want_phi, want_m = spec_update(group_phi[0], momentum, group_phi, group_delta, **NOLOCO)
    assert torch.allclose(new_phi.double(), want_phi, atol=1e-6, rtol=0)
    assert torch.allclose(new_m.double(), want_m, atol=1e-6, rtol=0)
    assert new_phi.dtype == torch.float32


def test_inputs_are_not_modified(gen):
    phi, m = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    other, d0, d1 = (torch.randn(8, generator=gen) for _ in range(3))
    copies = [t.clone() for t in (phi, m, other, d0, d1)]
    outer_update(phi, m, [phi, other], [d0, d1], **NOLOCO)
    for before, after in zip(copies, (phi, m, other, d0, d1)):
        assert torch.equal(before, after)


def test_everyone_in_group_is_diloco(gen):
    """Members of an all-worker group that share phi (DiLoCo's invariant): gamma is moot."""
    phi = torch.randn(50, generator=gen)
    deltas = [torch.randn(50, generator=gen) for _ in range(4)]
    with_gamma = outer_update(phi, torch.zeros(50), [phi] * 4, deltas, alpha=0.3, beta=0.7, gamma=0.9)
    without = outer_update(phi, torch.zeros(50), [phi] * 4, deltas, alpha=0.3, beta=0.7, gamma=0.0)
    assert torch.equal(with_gamma[0], without[0])
    assert torch.allclose(with_gamma[0], phi + 0.7 * torch.stack(deltas).mean(0), atol=1e-6)


def test_zero_momentum_zero_gamma_beta_one_is_plain_averaging(gen):
    phis = [torch.randn(20, generator=gen) for _ in range(2)]
    thetas = [torch.randn(20, generator=gen) for _ in range(2)]
    deltas = [t - p for t, p in zip(thetas, phis)]
    new_phi, _ = outer_update(phis[0], torch.zeros(20), phis, deltas, alpha=0.0, beta=1.0, gamma=1.0)
    # phi0 + mean(theta - phi) - (phi0 - mean(phi)) = mean(theta)
    assert torch.allclose(new_phi, (thetas[0] + thetas[1]) / 2, atol=1e-6)


def test_both_partners_end_with_identical_group_means(gen):
    phis = [torch.randn(1000, generator=gen) for _ in range(2)]
    deltas = [1e-3 * torch.randn(1000, generator=gen) for _ in range(2)]
    assert torch.equal(group_mean(phis), group_mean(phis[::-1]))
    assert torch.equal(group_mean(deltas), group_mean(deltas[::-1]))
    # With equal phi and momentum both partners land on exactly the same weights.
    a = outer_update(phis[0], torch.zeros(1000), [phis[0], phis[0]], deltas, **NOLOCO)
    b = outer_update(phis[0], torch.zeros(1000), [phis[0], phis[0]], deltas[::-1], **NOLOCO)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_group_means_do_not_depend_on_member_order_for_larger_groups(gen):
    members = [torch.randn(4096, generator=gen) for _ in range(5)]
    assert torch.equal(group_mean(members), group_mean([members[i] for i in (3, 1, 4, 0, 2)]))


def test_pair_update_pulls_partners_together(gen):
    """With no progress (Delta = 0) the gamma term contracts the distance between partners."""
    a, b = torch.randn(100, generator=gen), torch.randn(100, generator=gen)
    zero = torch.zeros(100)
    new_a, _ = outer_update(a, zero, [a, b], [zero, zero], **NOLOCO)
    new_b, _ = outer_update(b, zero, [b, a], [zero, zero], **NOLOCO)
    assert (new_a - new_b).norm() == pytest.approx((1 - NOLOCO["gamma"]) * (a - b).norm().item(), rel=1e-5)


def test_nesterov_looks_ahead():
    phi, m, d = torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([1.0])
    new_phi, new_m = outer_update(phi, m, [phi], [d], alpha=0.9, beta=0.7, gamma=0.0, nesterov=True)
    assert new_m.item() == pytest.approx(0.9 + 0.7)
    assert new_phi.item() == pytest.approx(0.7 + 0.9 * 1.6)


def test_list_form_matches_tensor_form(gen):
    shapes = [(3, 4), (5,)]
    phi = [torch.randn(s, generator=gen) for s in shapes]
    other = [torch.randn(s, generator=gen) for s in shapes]
    m = [torch.zeros(s) for s in shapes]
    deltas = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    new_phi, new_m = outer_update(phi, m, [phi, other], deltas, **NOLOCO)
    for k in range(2):
        single = outer_update(phi[k], m[k], [phi[k], other[k]], [deltas[0][k], deltas[1][k]], **NOLOCO)
        assert torch.equal(new_phi[k], single[0]) and torch.equal(new_m[k], single[1])


def test_bf16_phi_accumulates_in_fp32(gen):
    phi = torch.randn(64, generator=gen).bfloat16()
    d = (1e-3 * torch.randn(64, generator=gen)).bfloat16()
    new_phi, _ = outer_update(phi, torch.zeros(64), [phi, phi], [d, d], **NOLOCO)
    assert new_phi.dtype == torch.bfloat16
    assert torch.allclose(new_phi.float(), phi.float() + 0.7 * d.float(), atol=1e-2)


def test_rejects_mismatched_groups():
    t = torch.zeros(3)
    with pytest.raises(ValueError):
        outer_update(t, t, [t, t], [t], **NOLOCO)
    with pytest.raises(ValueError):
        outer_update(t, t, [t, torch.zeros(4)], [t, t], **NOLOCO)


def test_hyper_validation():
    with pytest.raises(ValueError):
        OuterHyper(alpha=1.0, beta=0.7, gamma=0.7)
    with pytest.raises(ValueError):
        OuterHyper(alpha=0.5, beta=0.0, gamma=0.7)


def test_slow_weights_local_round_moves_theta_to_new_phi(gen):
    param = torch.nn.Parameter(torch.randn(10, generator=gen))
    slow = SlowWeights([param], OuterHyper(**NOLOCO))
    start = param.detach().clone()
    with torch.no_grad():
        param.add_(1.0)  # inner progress Delta = 1
    slow.apply_local()
    assert torch.allclose(param.detach(), start + 0.7, atol=1e-6)
    assert torch.equal(slow.phi[0], param.detach())
    assert torch.allclose(slow.momentum[0], torch.full((10,), 0.7))
    assert math.isclose(float(slow.deltas()[0].abs().max()), 0.0)


def test_an_overlapped_step_with_no_steps_in_between_is_the_blocking_step(gen):
    hyper = OuterHyper(alpha=0.5, beta=0.7, gamma=0.7)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(2)]
    blocking, overlapped = SlowWeights(params, hyper), SlowWeights([torch.nn.Parameter(p.detach().clone())
                                                                     for p in params], hyper)
    with torch.no_grad():
        for a, b in zip(params, overlapped.params):
            step = torch.randn(4, 3, generator=gen)
            a.add_(step)
            b.add_(step)
    partner = (
        [torch.randn(4, 3, generator=gen) for _ in range(2)],
        [torch.randn(4, 3, generator=gen) for _ in range(2)],
    )
    sent = (overlapped.phi, overlapped.deltas())
    start = overlapped.start_overlapped()
    blocking.apply([blocking.phi, partner[0]], [blocking.deltas(), partner[1]])
    overlapped.apply_overlapped([sent[0], partner[0]], [sent[1], partner[1]], start)
    for a, b in zip(blocking.params, overlapped.params):
        assert torch.equal(a, b)


def test_an_overlapped_step_keeps_the_progress_made_while_the_exchange_ran(gen):
    """theta <- phi_new + (theta_now - theta_start): the steps taken meanwhile are
    neither lost nor applied twice (ALGORITHM.md section 3.1)."""
    hyper = OuterHyper(alpha=0.5, beta=0.7, gamma=0.7)
    params = [torch.nn.Parameter(torch.randn(5, generator=gen))]
    slow = SlowWeights(params, hyper)
    with torch.no_grad():
        params[0].add_(torch.randn(5, generator=gen))  # the round's inner steps
    sent_phi, sent_delta = [slow.phi[0].clone()], slow.deltas()
    start = slow.start_overlapped()
    local_phi, _ = outer_update(sent_phi, [torch.zeros(5)], [sent_phi], [sent_delta], alpha=0.5, beta=0.7,
                                gamma=0.7)
    # the steps beside the exchange start from the local step
    assert torch.allclose(params[0].detach(), local_phi[0])
    meanwhile = torch.randn(5, generator=gen)
    with torch.no_grad():
        params[0].add_(meanwhile)  # inner steps while the exchange runs
    partner = ([torch.randn(5, generator=gen)], [torch.randn(5, generator=gen)])
    expected_phi, _ = outer_update(sent_phi, [torch.zeros(5)], [sent_phi, partner[0]], [sent_delta,
                                                                                        partner[1]],
                                   alpha=0.5, beta=0.7, gamma=0.7)
    slow.apply_overlapped([sent_phi, partner[0]], [sent_delta, partner[1]], start)
    assert torch.allclose(slow.phi[0], expected_phi[0])
    assert torch.allclose(params[0].detach(), expected_phi[0] + meanwhile, atol=1e-6)
    assert torch.allclose(slow.deltas()[0], meanwhile, atol=1e-6)  # the next round's Delta starts with it


def _a_round_taken(gen):
    """A worker of one 5-value tensor after a round's inner steps, and what it sends."""
    params = [torch.nn.Parameter(torch.randn(5, generator=gen))]
    slow = SlowWeights(params, OuterHyper(alpha=0.5, beta=0.7, gamma=0.7))
    with torch.no_grad():
        params[0].add_(torch.randn(5, generator=gen))
    return params, slow, [slow.phi[0].clone()], slow.deltas()


def test_a_delta_landed_ahead_of_phi_moves_the_steps_to_the_groups_delta_step_and_keeps_their_progress(gen):
    """Delta first (ALGORITHM.md 3.1): theta moves to the group's Delta step plus the
    progress made so far; phi, momentum and the gamma pull wait for the phi; once it is
    in, the round ends where the whole payload landing at once would have put it."""
    params, slow, sent_phi, sent_delta = _a_round_taken(gen)
    phi_before, momentum_before = slow.phi[0].clone(), slow.momentum[0].clone()
    start = slow.start_overlapped()
    before_delta, after_delta = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    with torch.no_grad():
        params[0].add_(before_delta)
    partner = ([torch.randn(5, generator=gen)], [torch.randn(5, generator=gen)])
    start = slow.land_deltas([sent_delta, partner[1]], start)
    delta_step, _ = outer_update(sent_phi, [torch.zeros(5)], [sent_phi, sent_phi], [sent_delta, partner[1]],
                                 alpha=0.5, beta=0.7, gamma=0.7)
    assert torch.allclose(start[0], delta_step[0])
    assert torch.allclose(params[0].detach(), delta_step[0] + before_delta, atol=1e-6)
    assert torch.equal(slow.phi[0], phi_before) and torch.equal(slow.momentum[0], momentum_before)
    with torch.no_grad():
        params[0].add_(after_delta)
    slow.apply_overlapped([sent_phi, partner[0]], [sent_delta, partner[1]], start)
    expected_phi, _ = outer_update(sent_phi, [torch.zeros(5)], [sent_phi, partner[0]], [sent_delta,
                                                                                        partner[1]],
                                   alpha=0.5, beta=0.7, gamma=0.7)
    assert torch.allclose(slow.phi[0], expected_phi[0])
    assert torch.allclose(params[0].detach(), expected_phi[0] + before_delta + after_delta, atol=1e-5)


def test_a_partner_lost_after_its_delta_leaves_the_local_only_step(gen):
    """Its phi never comes: our own payload from the moved start is the local-only step,
    the progress kept, as if its Delta had never landed."""
    params, slow, sent_phi, sent_delta = _a_round_taken(gen)
    start = slow.start_overlapped()
    local_start = start[0].clone()
    meanwhile = torch.randn(5, generator=gen)
    with torch.no_grad():
        params[0].add_(meanwhile)
    start = slow.land_deltas([sent_delta, [torch.randn(5, generator=gen)]], start)
    assert not torch.allclose(params[0].detach(), local_start + meanwhile, atol=1e-3)
    slow.apply_overlapped([sent_phi], [sent_delta], start)
    assert torch.allclose(params[0].detach(), local_start + meanwhile, atol=1e-5)
    assert torch.allclose(slow.phi[0], local_start, atol=1e-6)

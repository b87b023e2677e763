"""A stage's state as a joiner downloads it (wire/state_codec.py): at most 8 bytes a
parameter (fp32 took 20); phi within the state check's slack for replicas that have not
moved; moments that pass the bound an Adam keeps when the donor's did; decoded the same
however the chunks split the tensors; anything a donor could bend is a ProtocolError;
and a joiner from the coded state trains as well as one from the fp32 state."""

from __future__ import annotations

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_node.data.spec import DataSpec
from swarm_node.errors import ProtocolError
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.blockwise import Quantized, dequantize_log, quantize_log
from swarm_node.wire.state_codec import (
    StateDecoder,
    encode_state,
    encoded_snapshot,
    wire_bytes_cap,
    wire_tensor_count,
)

H, VOCAB, BATCH, SEQ = 10, 64, 8, 32
SPEC = RunSpec(model_size="debug", num_stages=1, seq_len=SEQ, batch_size=BATCH, samples_per_step=BATCH,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=H),
               inner=InnerHyper(lr=3e-3, warmup_steps=20, total_steps=2000))
BIGRAM = torch.softmax(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(123)) * 3, dim=1)


def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Text of a fixed random bigram chain: something a model learns within rounds."""
    x = torch.zeros(BATCH, SEQ + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for t in range(SEQ):
        x[:, t + 1] = torch.multinomial(BIGRAM[x[:, t]], 1, generator=g).squeeze(1)
    return x[:, :-1], x[:, 1:]


def paired_round(a: StageWorker, b: StageWorker, ga: torch.Generator, gb: torch.Generator) -> list[float]:
    """H inner steps each, then a's and b's outer round with each other; a's losses."""
    losses = []
    for worker, g in ((a, ga), (b, gb)):
        for _ in range(H):
            x, y = batch(g)
            loss, _ = worker.forward_backward_last(None, y, token_inputs=x)
            worker.step()
            if worker is a:
                losses.append(loss)
    a.open_round()
    b.open_round()
    pa, pb = a.own_payload(), b.own_payload()
    a.close_round([pb])
    b.close_round([pa])
    return losses


def round_trip(worker: StageWorker, split: int | None = None) -> tuple[list[torch.Tensor], ...]:
    """(the snapshot's fp32 tensors, as a joiner decodes them), fed ``split`` wire tensors at a time."""
    shapes = [p.shape for p in worker.params]
    snap = worker.snapshot()
    wire = encoded_snapshot(snap, len(shapes), worker.slow is not None)["tensors"]
    decoder = StateDecoder(shapes, worker.slow is not None)
    split = split or len(wire)
    for start in range(0, len(wire), split):
        decoder.feed(wire[start:start + split])
    return snap["tensors"], decoder.finish()


@pytest.fixture(scope="module")
def trained() -> tuple[StageWorker, StageWorker]:
    a, b = StageWorker(SPEC, 0, VOCAB), StageWorker(SPEC, 0, VOCAB)
    ga, gb = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    for _ in range(3):
        paired_round(a, b, ga, gb)
    for _ in range(3):  # into the next round: theta apart from phi
        x, y = batch(ga)
        a.forward_backward_last(None, y, token_inputs=x)
        a.step()
    return a, b


def test_a_joiner_downloads_at_most_8_bytes_a_parameter(trained):
    worker = trained[0]
    wire = encoded_snapshot(worker.snapshot(), len(worker.params), True)["tensors"]
    parameters = sum(p.numel() for p in worker.params)
    sent = sum(t.numel() * t.element_size() for t in wire)
    assert len(wire) == wire_tensor_count(len(worker.params), True)
    assert sent / parameters < 7.2  # 3.02 phi, 1.02 each theta - phi, momentum, exp_avg, exp_avg_sq
    assert sent <= wire_bytes_cap([p.shape for p in worker.params], True)


def test_each_part_comes_within_its_codes_precision(trained):
    worker = trained[0]
    n = len(worker.params)
    sent, got = round_trip(worker)

    def error(part: int) -> float:
        x = torch.cat([t.flatten() for t in sent[part * n:(part + 1) * n]])
        y = torch.cat([t.flatten() for t in got[part * n:(part + 1) * n]])
        return float((x - y).norm() / x.norm())

    assert error(1) < 1e-5  # phi: below the state check's slack where replicas have not moved (EPS)
    assert error(0) < 1e-3 and error(2) < 0.02 and error(3) < 0.02 and error(4) < 0.05
    for v, back in zip(sent[4 * n:5 * n], got[4 * n:5 * n]):
        assert bool((back >= v * (1 - 1e-6)).all())  # exp_avg_sq never below: Adam steps never larger
    assert torch.equal(sent[-1], got[-1])
    assert worker.snapshot_problem(got) is None


def test_the_chunks_split_changes_nothing(trained):
    _, whole = round_trip(trained[0])
    _, pieces = round_trip(trained[0], split=3)
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces))


def test_moments_near_the_bound_an_adam_keeps_pass_it_as_decoded():
    """Gradients built to bring exp_avg close to sqrt(C exp_avg_sq) (one large gradient, then
    near-silence): rounded up, exp_avg_sq keeps the decoded moments within the bound."""
    worker = StageWorker(SPEC, 0, VOCAB)
    for scale in (1.0, 1.0, 1e3, 1e-6, 1e-6):
        for p in worker.params:
            p.grad = torch.full_like(p, scale)
        worker.step()
    _, got = round_trip(worker)
    assert worker.snapshot_problem(got) is None


def test_without_an_outer_step_theta_goes_as_phi_would():
    spec = RunSpec(**{**SPEC.__dict__, "method": default_method("local")})
    worker = StageWorker(spec, 0, VOCAB)
    assert worker.slow is None
    sent, got = round_trip(worker)
    assert len(got) == worker.state_tensor_count() and worker.snapshot_problem(got) is None
    n = len(worker.params)
    assert all(float((a - b).norm()) <= 1e-5 * float(a.norm()) for a, b in zip(sent[:n], got[:n]))


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(0, 2.0 ** 100, width=32), min_size=1, max_size=600))
def test_log_codes_round_up_within_a_sixteenth_of_an_octave(values):
    v = torch.tensor(values)
    back = dequantize_log(quantize_log(v))
    top = v.max()
    reach = v >= top * 2 ** -15.9
    assert bool((back[v == 0] == 0).all())
    assert bool((back >= v * (1 - 1e-6) - 1e-44).all())  # 1e-44: fp32's subnormals round
    assert bool((back[reach] <= v[reach] * 2 ** (1 / 16) * (1 + 1e-6)).all())


# -- what a donor could bend -------------------------------------------------------------------------
SHAPES = [torch.Size([3, 5]), torch.Size([300]), torch.Size([4])]
DTYPES = [torch.float16, torch.float32, torch.uint8, torch.int64, torch.bfloat16]


def honest_wire(slow: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=g) for _ in range(3 if slow else 1) for s in SHAPES]
    v = [torch.rand(s, generator=g) ** 4 for s in SHAPES]
    m = [torch.randn(s, generator=g) * 0.1 * x.sqrt() for s, x in zip(SHAPES, v)]
    return encode_state([*weights, *m, *v, torch.tensor([3.0, 3.0, 0.0])], len(SHAPES), slow)


def bent(t: torch.Tensor, how: str, data) -> torch.Tensor:
    if how == "dtype":
        return t.to(data.draw(st.sampled_from(DTYPES)))
    if how == "length":
        return torch.cat([t.flatten(), t.flatten()[:1]]) if data.draw(st.booleans()) else t.flatten()[1:]
    if how == "value":
        if t.numel() == 0:
            return t
        flat = t.flatten().clone()
        i = data.draw(st.integers(0, flat.numel() - 1))
        if not flat.is_floating_point():
            flat[i] = data.draw(st.integers(0, 255))
        else:
            flat[i] = data.draw(st.sampled_from([float("nan"), float("inf"), -1.0, 3e38, 1e-40, 0.0]))
        return flat.view(t.shape)
    return t.reshape(1, -1)  # "shape"


@settings(max_examples=300, deadline=None)
@given(slow=st.booleans(), data=st.data())
def test_a_bent_state_decodes_to_the_stages_shapes_or_is_a_protocol_error(slow, data):
    wire = honest_wire(slow)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(wire) - 1))
        wire[i] = bent(wire[i], data.draw(st.sampled_from(["dtype", "length", "value", "shape"])), data)
    if data.draw(st.booleans()):
        wire = wire[:-1] if data.draw(st.booleans()) else [*wire, wire[0]]
    decoder = StateDecoder(SHAPES, slow)
    try:
        decoder.feed(wire)
        state = decoder.finish()
    except ProtocolError:
        return
    weights = (3 if slow else 1) * len(SHAPES)
    assert [t.shape for t in state[:weights + 2 * len(SHAPES)]] == SHAPES * ((3 if slow else 1) + 2)
    assert all(t.dtype == torch.float32 for t in state)
    assert all(bool(torch.isfinite(t).all()) for t in state[:weights])  # levels and codes: finite by check


def test_log_codes_refuse_other_widths_and_bad_scales():
    q = quantize_log(torch.rand(300))
    nan = q.scales * float("nan")
    for bad in (Quantized(q.codes, q.scales, q.shape, 4), Quantized(q.codes, nan, q.shape, 8),
                Quantized(q.codes, -q.scales, q.shape, 8), Quantized(q.codes[1:], q.scales, q.shape, 8)):
        with pytest.raises(ProtocolError):
            dequantize_log(bad)


# -- training after the join ------------------------------------------------------------------------
def test_a_joiner_from_the_coded_state_trains_as_well_as_from_the_fp32_state(trained):
    """Two replicas paired for 3 rounds; a joiner restored from one's snapshot, fp32 or as
    decoded, trains 2 rounds beside a copy of the other on the same data. Measured (3 seeds,
    8 rounds before the join, tmp script of the commit): the coded joiner's mean loss over
    the 2 rounds was 0.0006-0.0009 *below* the fp32 joiner's, where other data for the
    same fp32 joiner moved it by 0.003-0.017; the bound is a third of the smallest."""
    donor, partner = trained
    snap = donor.snapshot()
    _, decoded = round_trip(donor)
    means = {}
    for name, tensors in (("fp32", snap["tensors"]), ("coded", decoded)):
        joiner = StageWorker(SPEC, 0, VOCAB)
        joiner.load_snapshot(snap["inner_step"], snap["outer_round"], tensors, snap["last_round_step"])
        mate = StageWorker(SPEC, 0, VOCAB)
        mate.load_checkpoint_state(*partner.checkpoint_state())
        gj, gp = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
        means[name] = statistics.mean(paired_round(joiner, mate, gj, gp) + paired_round(joiner, mate, gj, gp))
    assert means["coded"] <= means["fp32"] + 0.001, means

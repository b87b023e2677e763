"""The outer codecs (wire/outer_codec.py): every codec round-trips phi and Delta within
its precision, the run's default sends at most 1 byte a parameter, and anything a
partner could send that does not fit our stage is a ProtocolError before anything is
allocated."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_node.cli.args import OUTER_CODEC_NAMES
from swarm_node.errors import ConfigError, ProtocolError
from swarm_node.spec import RunSpec
from swarm_node.wire.frames import WIRE_PRECISIONS
from swarm_node.wire.outer_codec import OUTER_CODECS, OuterEncoder, decode_outer, outer_codec

SHAPES = [torch.Size([300, 7]), torch.Size([5]), torch.Size([0]), torch.Size([1000])]


def tensors(gen: torch.Generator, scale: float) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=gen) * scale for shape in SHAPES]


def test_the_command_line_offers_exactly_the_codecs_there_are():
    assert OUTER_CODEC_NAMES == tuple(OUTER_CODECS)


@pytest.mark.parametrize("name", OUTER_CODECS)
@pytest.mark.parametrize("had_partner", [False, True])
def test_every_codec_round_trips_within_its_precision(name, had_partner):
    gen = torch.Generator().manual_seed(0)
    codec = outer_codec(name)
    phi, delta = tensors(gen, 0.02), tensors(gen, 1e-3)
    receivers_phi = [t + torch.randn(t.shape, generator=gen) * 1e-3 for t in phi]
    encoder = OuterEncoder(codec)
    if had_partner:  # the last partner was as far as this receiver (a near codec's grid fits it)
        encoder.observe(phi, [receivers_phi])
    wire = encoder.encode(phi, delta)
    got_phi, got_delta = decode_outer(wire, SHAPES, codec, torch.device("cpu"), near=receivers_phi)
    # the distance a near codec expects: as far as its own Delta reaches, or its last partner if further
    gaps = [max(d.abs().max(), (r - t).abs().max() if had_partner else 0) if t.numel() else None
            for t, d, r in zip(phi, delta, receivers_phi)]
    for kind, sent, got in (("phi", phi, got_phi), ("delta", delta, got_delta)):
        bits = codec.phi_bits if kind == "phi" else codec.delta_bits
        for t, g, gap in zip(sent, got, gaps):
            assert g.shape == t.shape and g.dtype.is_floating_point
            if t.numel():
                # within half a step: of the block's largest value over the largest code, of the
                # partners' distance when coded near, of fp16 rounding
                float_eps = torch.finfo(WIRE_PRECISIONS[codec.precision]).eps
                if bits is None:
                    tolerance = t.abs().max() * float_eps
                elif kind == "phi" and codec.phi_near:
                    tolerance = gap / (2 ** (bits - 1) - 1)  # half a step of twice the gap over the levels
                else:
                    tolerance = t.abs().max() / (2 ** (bits - 1) - 1) / 2
                assert (g.float() - t).abs().max() <= tolerance * 1.001 + 1e-9


def test_rounds_with_a_clone_leave_the_grid_reaching_a_partner_as_far_as_recent_ones():
    """A joiner and its donor start on the same phi: rounds they pair in see a distance of
    about nothing. The next partner, as far as the ones before, must still decode to its
    phi, not to something near the receiver's own (the grid shrank 0.7 a round once, and
    a node that misread its partners was not pulled to them: stages drifted apart)."""
    gen = torch.Generator().manual_seed(3)
    codec = outer_codec("near4-3")
    phi, delta = tensors(gen, 0.02), tensors(gen, 1e-4)
    far = [t + torch.randn(t.shape, generator=gen) * 3e-3 for t in phi]
    encoder = OuterEncoder(codec)
    encoder.observe(phi, [far])  # a partner at the stage's usual distance
    for _ in range(6):  # then the clone, round after round
        encoder.observe(phi, [[t.clone() for t in phi]])
    got_phi, _ = decode_outer(encoder.encode(phi, delta), SHAPES, codec, torch.device("cpu"), near=far)
    for t, g, f in zip(phi, got_phi, far):
        if t.numel():
            step = 2 * (f - t).abs().max() / (2 ** (codec.phi_bits - 1) - 1)
            assert (g - t).abs().max() <= step, "the partner read the sender's phi wrongly"


@pytest.mark.parametrize("name", OUTER_CODECS)
def test_the_bytes_on_the_wire_are_what_the_codec_says(name):
    codec = outer_codec(name)
    shapes = [torch.Size([64, 1024]), torch.Size([4096])]
    phi = [torch.randn(s) for s in shapes]
    encoder = OuterEncoder(codec)
    encoder.observe(phi, [[t + 0.01 for t in phi]])  # near codecs: after a first partner
    wire = encoder.encode(phi, phi)
    numel = sum(s.numel() for s in shapes)
    assert sum(t.numel() * t.element_size() for t in wire) / numel == pytest.approx(
        codec.bytes_per_parameter()
    )


def test_the_default_codec_sends_at_most_a_quarter_of_a_16_bit_round():
    default = outer_codec(RunSpec().outer_codec)
    assert default.bytes_per_parameter() <= 1.0 <= 0.25 * outer_codec("fp16").bytes_per_parameter()


def test_error_feedback_counts_only_once_a_round_is_done():
    encoder = OuterEncoder(outer_codec("int4"))
    gen = torch.Generator().manual_seed(1)
    phi, delta = tensors(gen, 0.02), tensors(gen, 1e-3)
    first = encoder.encode(phi, delta)
    assert encoder.encode(phi, delta)[0].equal(first[0])  # the first round was given up: nothing carried
    encoder.commit()
    again = encoder.encode(phi, delta)
    assert not all(a.equal(b) for a, b in zip(again, first))  # now the remainder rides along


def test_a_run_spec_names_a_known_codec_and_the_codec_changes_its_hash():
    with pytest.raises(ConfigError, match="outer_codec"):
        RunSpec(outer_codec="zip")
    assert RunSpec(outer_codec="int8").spec_hash() != RunSpec(outer_codec="int4").spec_hash()


tensor_bytes = st.sampled_from([torch.uint8, torch.float32, torch.float16, torch.int64])


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(list(OUTER_CODECS)), data=st.data())
def test_anything_that_does_not_fit_our_stage_is_a_protocol_error(name, data):
    codec = outer_codec(name)
    shapes = [torch.Size([3, 100]), torch.Size([7])]
    count = data.draw(st.integers(0, 10))
    sent = []
    for _ in range(count):
        dtype = data.draw(tensor_bytes)
        length = data.draw(st.integers(0, 400))
        sent.append(torch.zeros(length, dtype=dtype) if dtype != torch.float32 else
                    torch.tensor(data.draw(st.lists(st.floats(width=32), min_size=length, max_size=length)),
                                 dtype=torch.float32))
    near = [torch.zeros(s) for s in shapes]
    try:
        phi, delta = decode_outer(sent, shapes, codec, torch.device("cpu"), near=near)
    except ProtocolError:
        return
    assert [t.shape for t in phi] == shapes and [t.shape for t in delta] == shapes
    # blockwise values are finite by construction; float ones are screened by the partner check
    if codec.phi_bits:
        assert all(torch.isfinite(t).all() for t in phi)


def test_deltas_share_of_a_round_is_what_its_codec_sends_of_it():
    assert OUTER_CODECS["fp16"].delta_share() == 0.5
    near = OUTER_CODECS["near4-3"]
    assert near.delta_share() == pytest.approx((3 / 8 + 4 / 256) / near.bytes_per_parameter())


def test_the_simulators_landings_are_the_clis():
    from swarm_node.cli.args import OUTER_LANDING_NAMES
    from swarm_node.sim.config import OUTER_LANDINGS

    assert OUTER_LANDING_NAMES == OUTER_LANDINGS

"""A coded stage boundary on the wire (wire/boundary.py): sized to its ratio with
everything in the frame counted, round trips within the blockwise step, and a hostile
payload (wrong shapes, NaN, huge values, ids outside the vocabulary, a width that is
not the run's) is a ProtocolError, never a crash or a wrong tensor."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_node.errors import ConfigError, ProtocolError
from swarm_node.wire.boundary import (
    BOUNDARY_CODECS,
    BoundaryCodec,
    boundary_codec,
    bytes_per_token,
    check_forward_request,
    check_gradient,
    forward_request,
    gradient_answer,
    pack_ids,
    unpack_ids,
    window_ids,
)
from swarm_node.wire.frames import decode_frame, encode_frame

CODEC = BoundaryCodec("bottleneck", 8, width=6, vocab_size=50)
CHECK = dict(spec_hash="s", max_batch=8, max_seq=32, default_deadline_s=30.0)
HEADER = {"kind": "fwd", "spec": "s", "deadline_s": 5.0}


def _request(code, ids, codec=CODEC):
    return check_forward_request(*decode_frame(forward_request(HEADER, code, ids, codec)), codec, **CHECK)


@pytest.mark.parametrize("name", BOUNDARY_CODECS)
@pytest.mark.parametrize("hidden,ratio", [(768, 32), (768, 64), (768, 8), (256, 16), (128, 32), (64, 16)])
def test_a_codec_sized_for_a_ratio_sends_at_most_that_share_of_fp16_each_way(name, hidden, ratio):
    codec = boundary_codec(name, hidden_size=hidden, ratio=ratio, vocab_size=4096, batch=16, seq=64)
    forward, backward = bytes_per_token(codec, 16, 64)
    budget = 2 * hidden / ratio
    assert forward <= budget and backward <= budget
    wider = BoundaryCodec(codec.kind, codec.bits, codec.width + 1, codec.vocab_size)
    assert bytes_per_token(wider, 16, 64)[0] > budget  # the widest that fits


def test_what_a_ratio_leaves_at_width_768():
    """The issue's budget at 32x: 48 bytes a token, of which the ids take 12 bits."""
    def sized(name):
        return {r: boundary_codec(name, hidden_size=768, ratio=r, vocab_size=4096, batch=16, seq=64).width
                for r in (8, 16, 32, 64, 100)}

    assert sized("bottleneck8") == {8: 187, 16: 92, 32: 45, 64: 22, 100: 13}
    assert sized("bottleneck4") == {8: 369, 16: 183, 32: 89, 64: 43, 100: 26}


def test_a_ratio_that_leaves_no_room_for_one_value_is_a_config_error():
    with pytest.raises(ConfigError, match="choose a lower ratio"):
        boundary_codec("bottleneck8", hidden_size=64, ratio=64, vocab_size=4096, batch=16, seq=64)
    with pytest.raises(ConfigError, match="activation_ratio"):
        boundary_codec("bottleneck8", hidden_size=64, ratio=1.0, vocab_size=4096, batch=16, seq=64)


@settings(max_examples=100, deadline=None)
@given(vocab=st.integers(2, 200_000), count=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_ids_pack_to_their_bits_and_back(vocab, count, seed):
    bits = max(1, math.ceil(math.log2(vocab)))
    ids = torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))
    packed = pack_ids(ids, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-count * bits // 8)
    assert torch.equal(unpack_ids(packed, bits, count), ids)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_forward_request_and_its_answer_decode_to_what_was_sent(bits):
    codec = BoundaryCodec("bottleneck", bits, width=6, vocab_size=50)
    g = torch.Generator().manual_seed(0)
    code, inputs = torch.randn(4, 32, 6, generator=g), torch.randint(0, 50, (4, 33), generator=g)
    deadline, got, got_inputs, got_targets = _request(code, inputs, codec)
    step = code.abs().max() / (2 ** (bits - 1) - 1)
    assert deadline == 5.0 and got.dtype == torch.float32 and got.shape == code.shape
    assert (got - code).abs().max() <= step / 2 * 1.001
    assert torch.equal(got_inputs, inputs[:, :-1]) and torch.equal(got_targets, inputs[:, 1:])
    assert torch.equal(window_ids(got_inputs, got_targets), inputs)
    _, tensors = decode_frame(gradient_answer({"ok": True, "loss": 1.0}, code, codec))
    assert (check_gradient(tensors, tuple(code.shape), codec) - code).abs().max() <= step / 2 * 1.001


@pytest.mark.parametrize("change,match", [
    (lambda h, t: ({**h, "batch": 9}, t), "does not fit"),
    (lambda h, t: ({**h, "seq": 0}, t), "does not fit"),
    (lambda h, t: ({**h, "seq": True}, t), "does not fit"),
    (lambda h, t: ({**h, "spec": "other"}, t), "not a forward request"),
    (lambda h, t: ({**h, "deadline_s": float("nan")}, t), "deadline"),
    (lambda h, t: (h, t[:2]), "codes, steps and token ids"),
    (lambda h, t: (h, [t[0], t[1], t[2][:-1]]), "token ids"),
    (lambda h, t: (h, [t[0], t[1], torch.full_like(t[2], 255)]), "out of the vocabulary"),
    (lambda h, t: (h, [t[0], torch.full_like(t[1], float("nan")), t[2]]), "finite"),
    (lambda h, t: (h, [t[0], torch.full_like(t[1], 3e38), t[2]]), "out of range"),
    (lambda h, t: (h, [t[0][:-1], t[1], t[2]]), "codes do not fit"),
])
def test_a_hostile_forward_request_is_a_protocol_error(change, match):
    header, tensors = decode_frame(forward_request(HEADER, torch.randn(2, 8, 6), torch.randint(0, 50, (2, 9)),
                                                   CODEC))
    header, tensors = change(header, tensors)
    with pytest.raises(ProtocolError, match=match):
        check_forward_request(header, tensors, CODEC, **CHECK)


def test_a_code_of_another_width_or_a_gradient_of_another_shape_is_refused():
    wider = BoundaryCodec("bottleneck", 8, width=7, vocab_size=50)
    header, tensors = decode_frame(forward_request(HEADER, torch.randn(2, 8, 7), torch.randint(0, 50, (2, 9)),
                                                   wider))
    with pytest.raises(ProtocolError):
        check_forward_request(header, tensors, CODEC, **CHECK)
    _, grad = decode_frame(gradient_answer({"ok": True, "loss": 1.0}, torch.randn(2, 8, 6), CODEC))
    with pytest.raises(ProtocolError, match="gradient"):
        check_gradient(grad, (2, 9, 6), CODEC)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_anything_a_peer_sends_decodes_to_the_stated_shape_or_is_a_protocol_error(data):
    """Any header numbers and any tensors: a ProtocolError, or a finite code of the
    declared micro-batch and the run's width with ids in the vocabulary."""
    header = {"kind": "fwd", "spec": "s",
              "batch": data.draw(st.one_of(st.integers(-2, 10), st.none(), st.floats(), st.text(max_size=2))),
              "seq": data.draw(st.one_of(st.integers(-2, 40), st.none(), st.booleans()))}
    tensors = []
    for _ in range(data.draw(st.integers(0, 4))):
        dtype = data.draw(st.sampled_from([torch.uint8, torch.float32, torch.float16, torch.int64]))
        dims = data.draw(st.one_of(st.lists(st.integers(0, 700), min_size=1, max_size=1),
                                   st.lists(st.integers(0, 30), min_size=2, max_size=3)))
        fill = data.draw(st.sampled_from([0.0, 1.0, 255.0, float("nan"), float("inf"), -3.0, 1e38]))
        tensors.append(torch.full(dims, fill).to(dtype) if dtype.is_floating_point else
                       torch.randint(0, 256 if dtype == torch.uint8 else 10**6, dims, dtype=dtype))
    raw = encode_frame({k: v for k, v in header.items() if v is not None}, tensors)
    try:
        _, code, inputs, targets = check_forward_request(*decode_frame(raw), CODEC, **CHECK)
    except ProtocolError:
        return
    batch, seq = header["batch"], header["seq"]
    assert code.shape == (batch, seq, CODEC.width) and code.dtype == torch.float32 and code.isfinite().all()
    assert inputs.shape == targets.shape == (batch, seq) and int(torch.cat([inputs, targets]).max()) < 50


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_gradient_answer_decodes_to_the_code_shape_or_is_a_protocol_error(data):
    shape = (data.draw(st.integers(1, 4)), data.draw(st.integers(1, 16)), CODEC.width)
    tensors = []
    for _ in range(data.draw(st.integers(0, 3))):
        dtype = data.draw(st.sampled_from([torch.uint8, torch.float32, torch.int64]))
        dims = data.draw(st.lists(st.integers(0, 500), min_size=1, max_size=2))
        fill = data.draw(st.sampled_from([0.0, 2.0, float("nan"), float("-inf"), 1e30]))
        tensors.append(torch.full(dims, fill).to(dtype) if dtype.is_floating_point else
                       torch.randint(0, 256, dims).to(dtype))
    try:
        grad = check_gradient(tensors, shape, CODEC)
    except ProtocolError:
        return
    assert grad.shape == shape and grad.dtype == torch.float32 and grad.isfinite().all()


def test_the_command_line_offers_exactly_the_boundary_codecs_there_are():
    from swarm_node.cli.args import BOUNDARY_CODEC_NAMES

    assert BOUNDARY_CODEC_NAMES == tuple(BOUNDARY_CODECS)


def test_a_run_spec_with_a_coded_boundary_names_its_ratio():
    from swarm_node.spec import RunSpec

    with pytest.raises(ConfigError, match="activation_ratio"):
        RunSpec(activation_codec="bottleneck4")
    with pytest.raises(ConfigError, match="activation_ratio"):
        RunSpec(activation_codec="int8", activation_ratio=32.0)
    with pytest.raises(ConfigError, match="activation_ratio"):
        RunSpec(activation_codec="bottleneck4", activation_ratio=float("nan"))
    coded = RunSpec(activation_codec="bottleneck4", activation_ratio=32.0)
    assert coded.spec_hash() != RunSpec(activation_codec="bottleneck4", activation_ratio=64.0).spec_hash()
    assert RunSpec.from_dict(coded.to_dict()) == coded


def test_a_node_builds_the_coded_model_the_simulator_builds():
    """One function (model/coded.py) sizes the code and cuts the model for both: a
    node's stage sends the simulator's width, through the encoder the seed draws."""
    from swarm_node.model.coded import coded_model
    from swarm_node.model.config import model_config
    from swarm_node.spec import RunSpec
    from swarm_node.train.worker import StageWorker

    spec = RunSpec(activation_codec="bottleneck4", activation_ratio=32.0)
    worker = StageWorker(spec, 0, 16)
    plain = model_config(spec.model_size, vocab_size=16, max_seq_len=spec.seq_len)
    config, codec = coded_model(plain, activation_codec="bottleneck4", activation_ratio=32.0,
                                batch_size=spec.batch_size, seq_len=spec.seq_len, num_stages=spec.num_stages)
    assert worker.model_config == config and worker.boundary == codec and worker.wire_codec == codec
    out = worker.forward(torch.zeros(2, 8, dtype=torch.long))
    assert out.shape == (2, 8, codec.width) and codec.width < plain.hidden_size
    assert coded_model(plain, activation_codec="int8", activation_ratio=None, batch_size=4, seq_len=8,
                       num_stages=2) == (plain, None)

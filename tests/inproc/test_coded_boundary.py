"""A coded stage boundary (docs/ALGORITHM.md section 9) through the node's real data path:
stage 0's pipeline sends the code and the window's token ids to the next stage's
``handle_forward`` and checks the gradient of the code that comes back, as between two
processes but joined back to back in one. Micro-batches cross, the loss falls, every
frame keeps to the ratio's bytes a token, a hostile request is refused and counted
against its sender, and the stage weights the boundary adds checkpoint and resume
exactly."""

import asyncio
import dataclasses

import pytest
import torch
from parts import StageParts
from stage_chain import Chain

from swarm_node.data.spec import DataSpec
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.hop_work import forward_request
from swarm_node.train.worker import StageWorker
from swarm_node.wire.boundary import window_ids
from swarm_node.wire.frames import decode_frame, encode_frame

RATIO = 32.0
VOCAB = 20  # 5 bits an id: a packed id can name one past the vocabulary
SPEC = RunSpec(run_id="coded", model_size="debug", num_stages=2, seq_len=32, batch_size=8, samples_per_step=8,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=1e-2, warmup_steps=1, total_steps=200),
               activation_codec="bottleneck8", activation_ratio=RATIO)


def coded(codec: str, **changes) -> RunSpec:
    return dataclasses.replace(SPEC, activation_codec=codec, **changes)


def batches(spec: RunSpec, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Windows of a learnable text: each token the one before plus one (mod VOCAB), from
    a random start."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        start = torch.randint(0, VOCAB, (spec.batch_size, 1), generator=g)
        window = (start + torch.arange(spec.seq_len + 1)) % VOCAB
        out.append((window[:, :-1], window[:, 1:]))
    return out


@pytest.mark.parametrize("codec", ["bottleneck8", "subspace4"])
def test_a_coded_boundary_trains_through_the_nodes_pipeline_within_its_bytes_a_token(codec):
    spec = coded(codec)
    chain = Chain(spec, vocab=VOCAB)
    worker = chain.parts[0].worker
    assert worker.boundary is not None and worker.boundary.kind == codec[:-1]
    chain.train(batches(spec, 40))
    losses = chain.losses
    assert len(losses) == 40 and all(0 < loss < 10 for loss in losses)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    hidden, tokens = worker.model_config.hidden_size, spec.batch_size * spec.seq_len
    budget = 2 * hidden / RATIO  # bytes a token each way, everything in the frame counted
    assert max(chain.requests) / tokens <= budget and max(chain.answers) / tokens <= budget
    assert chain.parts[1].guard.faults("QmCaller") == 0


def test_the_gradient_that_comes_back_is_the_next_stages_wrt_the_code():
    chain = Chain(SPEC, vocab=VOCAB)
    inputs, targets = batches(SPEC, 1)[0]
    first, second = chain.parts[0].worker, chain.parts[1].worker
    code = first.forward(inputs)
    assert code.shape == (SPEC.batch_size, SPEC.seq_len, first.boundary.width)
    from swarm_node.train.hop_work import outgoing

    grad, loss = asyncio.run(chain.pipelines[0].next_hop.send(*outgoing(code, first.wire_codec),
                                                               window_ids(inputs, targets), timeout_s=30.0))
    exact = code.clone().requires_grad_(True)
    StageWorker(SPEC, 1, VOCAB).stage(exact, targets, tokens=inputs).backward()  # the same seeded weights
    assert 0 < loss < 10 and second.inner_step == 1
    assert ((grad - exact.grad).norm() / exact.grad.norm()).item() < 0.05


@pytest.mark.parametrize("codec", ["bottleneck8", "fp16"])
def test_a_middle_stage_reads_the_ids_decodes_the_code_and_passes_both_on(codec):
    """fp16 too: a middle stage answers with the loss the last stage found."""
    ratio = RATIO if codec == "bottleneck8" else None
    spec = coded(codec, model_size="mini", num_stages=3, layers_per_stage=(1, 2, 1), activation_ratio=ratio)
    chain = Chain(spec, vocab=VOCAB)
    chain.train(batches(spec, 3))
    assert len(chain.losses) == 3 and all(0 < loss < 10 for loss in chain.losses)
    assert [p.worker.inner_step for p in chain.parts] == [3, 3, 3]
    assert all(p.guard.faults("QmCaller") == 0 for p in chain.parts)


def _unframed(raw: bytes) -> tuple[dict, list[torch.Tensor]]:
    """A frame's header (without the keys the frame itself adds) and tensors."""
    header, tensors = decode_frame(raw)
    return {k: v for k, v in header.items() if k not in ("v", "tensors")}, tensors


def _request(spec: RunSpec) -> tuple[dict, list[torch.Tensor]]:
    first = StageWorker(spec, 0, VOCAB)
    inputs, targets = batches(spec, 1)[0]
    return _unframed(forward_request({"kind": "fwd", "spec": spec.spec_hash(), "deadline_s": 30.0},
                                     first.forward(inputs), window_ids(inputs, targets), first.wire_codec))


def _hostile(header: dict, tensors: list[torch.Tensor]) -> dict[str, tuple[dict, list[torch.Tensor]]]:
    codes, steps, ids = tensors
    nan_steps, huge_steps = steps.clone(), steps.clone()
    nan_steps[0] = float("nan")
    huge_steps[0] = 1e38
    over = ids.clone()
    over[0] = 0xFF  # the first ids read 31: past a vocabulary of 20
    return {
        "wrong spec": ({**header, "spec": "0" * 16}, tensors),
        "batch past the cap": ({**header, "batch": 10**6}, tensors),
        "seq past the cap": ({**header, "seq": SPEC.seq_len + 1}, tensors),
        "batch not the code's": ({**header, "batch": header["batch"] - 1}, tensors),
        "seq as a float": ({**header, "seq": float(header["seq"])}, tensors),
        "no ids": (header, [codes, steps]),
        "ids cut short": (header, [codes, steps, ids[:-1]]),
        "ids as int32": (header, [codes, steps, ids.to(torch.int32)]),
        "ids out of the vocabulary": (header, [codes, steps, over]),
        "codes of another width": (header, [codes[:-8], steps, ids]),
        "NaN step": (header, [codes, nan_steps, ids]),
        "huge values": (header, [codes, huge_steps, ids]),
        "steps as float16": (header, [codes, steps.half(), ids]),
        "deadline past the cap": ({**header, "deadline_s": 1e9}, tensors),
    }


@pytest.mark.parametrize("case", list(_hostile(*_request(SPEC))))
def test_a_hostile_coded_forward_request_is_refused_and_counted_against_its_sender(case):
    header, tensors = _hostile(*_request(SPEC))[case]
    second = StageParts(SPEC, StageWorker(SPEC, 1, VOCAB))
    server = second.pipeline()
    answer, _ = decode_frame(asyncio.run(server.handle_forward("QmBad", encode_frame(header, tensors))))
    assert answer["ok"] is False and answer["error"].startswith("protocol:"), answer
    assert second.guard.faults("QmBad") == 1 and second.worker.pending_microbatches == 0
    good, _ = decode_frame(asyncio.run(server.handle_forward("QmGood", encode_frame(*_request(SPEC)))))
    assert good["ok"] is True and second.guard.faults("QmGood") == 0  # the node goes on


@pytest.mark.parametrize("bad", ["NaN step", "another width", "no loss"])
def test_a_hostile_gradient_answer_to_a_coded_request_is_a_protocol_error(bad):
    from swarm_node.errors import ProtocolError
    from swarm_node.wire.boundary import gradient_answer

    first = StageParts(SPEC, StageWorker(SPEC, 0, VOCAB))
    hop = first.pipeline().next_hop
    width = first.worker.boundary.width
    shape = (SPEC.batch_size, SPEC.seq_len, width)
    grad = torch.randn(shape)
    header, tensors = _unframed(gradient_answer({"ok": True, "loss": 2.0}, grad, first.worker.boundary))
    assert hop._check_gradient(encode_frame(header, tensors), torch.Size(shape))[1] == 2.0
    if bad == "NaN step":
        tensors[1][0] = float("nan")
    elif bad == "another width":
        shape = (SPEC.batch_size, SPEC.seq_len, width + 1)
    else:
        header = {"ok": True}
    with pytest.raises(ProtocolError):
        hop._check_gradient(encode_frame(header, tensors), torch.Size(shape))


def test_a_bottleneck_pipeline_checkpoints_and_resumes_to_identical_weights():
    """The encoder, decoder and anchor are ordinary weights of their stages: they are in
    the checkpoint, the snapshot a joiner downloads and the outer round's phi, so a
    resumed pair of stages trains on bit for bit."""
    data = batches(SPEC, 12)
    chain = Chain(SPEC, vocab=VOCAB)
    names = [[n for n, _ in p.worker.stage.named_parameters()] for p in chain.parts]
    assert any("encoder" in n for n in names[0]) and {"decoder", "anchor"} <= {
        part for n in names[1] for part in n.split(".")}
    for parts in chain.parts:
        worker = parts.worker
        assert len(worker.slow.phi) == len(worker.params)  # averaged by the outer rounds like any weight
        assert len(worker.snapshot()["tensors"]) == worker.state_tensor_count()
    chain.train(data[:6])
    saved = [p.worker.checkpoint_state() for p in chain.parts]
    chain.train(data[6:])
    resumed = [StageWorker(SPEC, s, VOCAB) for s in range(SPEC.num_stages)]
    for worker, (tensors, meta) in zip(resumed, saved):
        worker.load_checkpoint_state({k: v.clone() for k, v in tensors.items()}, meta)
    again = Chain(SPEC, resumed, vocab=VOCAB)
    again.train(data[6:])
    for ours, theirs in zip(chain.weights(), again.weights()):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert again.losses == chain.losses[6:]


def test_a_subspaces_fixed_basis_and_table_are_neither_saved_nor_sent():
    """U and T come from the run's seed on every peer: not parameters (so not averaged,
    downloaded or checkpointed), not in a state dict, and the same in a fresh worker."""
    spec = coded("subspace4")
    for stage in range(spec.num_stages):
        worker, fresh = StageWorker(spec, stage, VOCAB), StageWorker(spec, stage, VOCAB)
        buffers = dict(worker.stage.named_buffers())
        fixed = [n for n in buffers if n.endswith(("basis", "table"))]
        assert fixed
        names = {n for n, _ in worker.stage.named_parameters()} | set(worker.stage.state_dict())
        assert not names & set(fixed)
        assert set(worker.checkpoint_state()[1]["param_names"]).isdisjoint(fixed)
        assert all(torch.equal(buffers[n], dict(fresh.stage.named_buffers())[n]) for n in fixed)

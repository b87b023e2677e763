"""bench.gpu_volunteer's EMULATED card (bench/gpu_volunteer/emulation.py) inside the
node's real data path and outer round: the frames it sends across a stage boundary are
those of the real model, byte for byte, in every codec; the card's time counts as
training time; and its outer payload, padded to the real stage's size, crosses the
payload exchange's framing and decodes on a partner (refused without its padding)."""

from __future__ import annotations

import pytest
import torch
from parts import StageParts
from stage_chain import Chain

from bench.gpu_volunteer.emulation import EmulatedCard, installed, padding_bytes
from swarm_node.data.spec import DataSpec
from swarm_node.errors import ProtocolError
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame
from swarm_node.wire.outer_codec import outer_codec

VOCAB = 300  # what the card builds the model for; the data's ids are fewer (DATA_VOCAB)
DATA_VOCAB = 16
CARD = EmulatedCard(stage_s=(0.004, 0.006), forward_share=0.25, vocab_size=VOCAB,
                    real_params=(3_000_000, 4_000_000), stand_in_numel=2 * 256)
CODECS = [("fp16", None), ("int8", None), ("bottleneck8", 16.0)]


def spec_for(codec: str, ratio: float | None) -> RunSpec:
    return RunSpec(run_id="card", model_size="debug", num_stages=2, seq_len=32, batch_size=4,
                   samples_per_step=4,
                   data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
                   inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100), activation_codec=codec,
                   activation_ratio=ratio)


def through_the_pipeline(spec: RunSpec, workers: list[StageWorker], batches: int = 3) -> dict:
    """Stage 0's pipeline sends ``batches`` micro-batches to stage 1's handler (as over a
    link; none lost); returns what crossed and what each stage counted."""
    chain = Chain(spec, workers)
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, DATA_VOCAB, (spec.batch_size, spec.seq_len + 1), generator=g)
               for _ in range(batches)]
    chain.train([(w[:, :-1], w[:, 1:]) for w in windows])
    stats = chain.pipelines[0].stats
    return {"sizes": list(zip(chain.requests, chain.answers)), "lost": stats.microbatches_lost,
            "done": stats.microbatches_done, "faults": chain.parts[1].guard.faults("QmCaller"),
            "steps": [w.inner_step for w in workers], "training_s": [w.training_s for w in workers]}


@pytest.mark.parametrize(("codec", "ratio"), CODECS)
def test_the_emulated_card_sends_the_real_models_frames_through_the_real_data_path(codec, ratio):
    spec = spec_for(codec, ratio)
    real = through_the_pipeline(spec, [StageWorker(spec, s, VOCAB) for s in range(2)])
    with installed(CARD):
        workers = [StageWorker(spec, s, DATA_VOCAB) for s in range(2)]  # built at the card's vocabulary
        emulated = through_the_pipeline(spec, workers)
    assert all(sum(p.numel() for p in w.params) == CARD.stand_in_numel for w in workers)  # weights dropped
    assert workers[1].model_config.vocab_size == VOCAB
    assert (emulated["lost"], emulated["faults"], emulated["done"]) == (0, 0, 3)
    assert real["sizes"] and emulated["sizes"] == real["sizes"]  # the same frames, byte for byte in size
    assert emulated["steps"] == [3, 3]
    for busy, card_s in zip(emulated["training_s"], CARD.stage_s):  # the card's wait is training time
        assert busy >= 3 * card_s


def test_the_padded_outer_payload_is_the_real_stages_size_and_a_partner_decodes_it():
    spec = spec_for("fp16", None)
    codec = outer_codec(spec.outer_codec)
    with installed(CARD):
        ours, theirs = StageWorker(spec, 0, DATA_VOCAB), StageWorker(spec, 0, DATA_VOCAB)
        for worker in (ours, theirs):
            for _ in range(3):
                worker.forward(torch.zeros(spec.batch_size, spec.seq_len, dtype=torch.long))
                worker.backward(torch.zeros(spec.batch_size, spec.seq_len, dtype=torch.long),
                                torch.zeros(spec.batch_size, spec.seq_len, 64))
                worker.step()
        opened = ours.open_round(overlapped=True)
        parts = StageParts(spec, ours).exchange().payloads
        payload = parts.encode(opened.round_no, opened.wire, opened.steps)  # Delta ahead of phi, two frames
        real_bytes = CARD.real_params[0] * codec.bytes_per_parameter()
        assert abs(len(payload.phi) + len(payload.delta) - real_bytes) < 4096  # headers and framing
        assert parts.limits.max_payload_bytes > len(payload.phi)
        partner = StageParts(spec, theirs).exchange().payloads
        for name in ("delta", "phi"):
            _, tensors = decode_frame(payload.part(name), partner.limits)
            values = theirs.decode_part(tensors, name, torch.device("cpu"))
            assert [v.shape for v in values] == [p.shape for p in theirs.params]
            with pytest.raises(ProtocolError):
                theirs.decode_part(tensors[:-1], name, torch.device("cpu"))  # no padding: not this run's
        assert [t.shape for t in ours.own_payload()[0]] == [p.shape for p in ours.params]
        # the exchange's deadlines are the real payload's, not the stand-in's
        assert NodeConfig().exchange_link_s(0) == pytest.approx(
            1.5 * 2 * padding_bytes(ours) * 8 / (NodeConfig().slowest_link_mbit_s * 1e6))
    assert NodeConfig().exchange_link_s(0) == 0.0  # uninstalled: the node's own again

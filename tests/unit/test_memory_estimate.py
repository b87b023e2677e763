"""The per-stage memory estimate against what training really allocates, measured on
the CPU, so the estimate (and the volunteers' guide's table made from it) cannot drift
from the model and the worker."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from swarm_node.model.config import NAMED_SIZES, model_config
from swarm_node.model.memory import (
    CARD_RESERVE_BYTES,
    ROUND_IN_FLIGHT_BYTES_PER_PARAMETER,
    estimate_stage_memory,
    largest_micro_batch,
    largest_stage_memory,
    main,
    memory_table,
    stage_parameters,
)
from swarm_node.model.stages import PipelineStage, split_layers
from swarm_node.optim import default_method
from swarm_node.sim.simulator import simulator_memory
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker

VOCAB = 512
BATCH, SEQ = 4, 64


class PeakAllocation(TorchDispatchMode):
    """Peak bytes of the tensor storages that ops create while the mode is active (those
    of ``existing`` tensors, and views of them, do not count)."""

    def __init__(self, existing):
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _freed(self, key):
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in self.existing:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._freed, key)
        return out


def splits():
    for size, stage_counts in (("debug", (1, 2)), ("tiny", (1, 2, 3, 4))):
        for stages in stage_counts:
            for stage in range(stages):
                yield size, stages, stage


def test_stage_parameters_match_the_built_stages_of_every_named_size():
    for size in NAMED_SIZES:
        config = model_config(size, vocab_size=VOCAB, max_seq_len=SEQ)
        for stages in (1, 2, 4):
            try:
                layers = split_layers(config.num_layers, stages)
            except ValueError:
                continue
            for stage in range(stages):
                with torch.device("meta"):  # shapes only: the large model has 6.7B parameters
                    built = PipelineStage(config, stage, stages, layers[stage])
                counted = sum(p.numel() for p in built.parameters())
                assert stage_parameters(config, num_stages=stages, stage_index=stage) == counted, (size,
                                                                                                   stages,
                                                                                                   stage)
    config = model_config("tiny", vocab_size=VOCAB, max_seq_len=SEQ)
    with torch.device("meta"):
        built = PipelineStage(config, 1, 3, range(1, 4))
    assert stage_parameters(config, num_stages=3, stage_index=1, layers_per_stage=(1, 3, 0)) == \
        sum(p.numel() for p in built.parameters())


def _one_micro_batch(worker: StageWorker, gen: torch.Generator):
    """Inputs for one training call of the worker's stage, and the call."""
    tokens = torch.randint(0, worker.model_config.vocab_size, (BATCH, SEQ), generator=gen)
    hidden = torch.randn(BATCH, SEQ, worker.model_config.hidden_size, generator=gen)
    grad = torch.randn(BATCH, SEQ, worker.model_config.hidden_size, generator=gen) * 1e-3

    def run():
        if worker.is_last:
            worker.forward_backward_last(None if worker.is_first else hidden.clone(), tokens,
                                         tokens if worker.is_first else None)
        else:
            worker.backward(tokens if worker.is_first else hidden.clone(), grad)

    return (tokens, hidden, grad), run


def _state_bytes(worker: StageWorker) -> int:
    tensors = [*worker.params, *(p.grad for p in worker.params)]
    for state in worker.inner.state.values():
        tensors += [state["exp_avg"], state["exp_avg_sq"]]
    if worker.slow is not None:
        tensors += [*worker.slow.phi, *worker.slow.momentum]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("method", ["noloco", "local"])
@pytest.mark.parametrize("size, stages, stage", [("debug", 2, 0), ("debug", 2, 1), ("tiny", 3, 1), ("tiny", 1,
                                                                                                    0)])
def test_parameter_part_equals_the_state_after_a_step(gen, method, size, stages, stage):
    spec = RunSpec(model_size=size, num_stages=stages, batch_size=BATCH, seq_len=SEQ, samples_per_step=BATCH,
                   method=default_method(method))
    worker = StageWorker(spec, stage, VOCAB)
    _, run = _one_micro_batch(worker, gen)
    run()
    worker.step()  # Adam's moments now exist
    run()  # and gradients again, as while accumulating towards the next step
    estimate = estimate_stage_memory(worker.model_config, num_stages=stages, stage_index=stage,
                                     batch_size=BATCH,
                                     seq_len=SEQ, autocast_bf16=False, outer_state=method == "noloco")
    assert estimate.parameters == sum(p.numel() for p in worker.params)
    in_flight = ROUND_IN_FLIGHT_BYTES_PER_PARAMETER * estimate.parameters if method == "noloco" else 0
    assert estimate.state_bytes - in_flight == _state_bytes(worker)
    assert estimate.state_bytes == (40 if method == "noloco" else 16) * estimate.parameters


@pytest.mark.parametrize("codec", ["fp16", "near4-3", "int8"])
def test_a_round_under_way_beside_the_inner_steps_fits_the_estimate(gen, codec):
    """The worst case: error feedback kept from the last round, and the next one's
    snapshot and payload held while the steps go on."""
    spec = RunSpec(model_size="debug", num_stages=2, batch_size=BATCH, seq_len=SEQ, samples_per_step=BATCH,
                   outer_codec=codec)
    worker = StageWorker(spec, 1, VOCAB)
    _, run = _one_micro_batch(worker, gen)
    run()
    worker.step()
    for _ in range(2):
        worker.open_round(overlapped=True)
    worker.close_round([])
    opened = worker.open_round(overlapped=True)
    run()
    kept = [*opened.wire, *opened.theta_start,
            *(t for f in worker.encoder.feedback.values() if f and f.residual for t in f.residual)]
    estimate = estimate_stage_memory(worker.model_config, num_stages=2, stage_index=1, batch_size=BATCH,
                                     seq_len=SEQ, autocast_bf16=False)
    measured = _state_bytes(worker) + sum(t.numel() * t.element_size() for t in kept)
    assert 0.7 * estimate.state_bytes <= measured <= estimate.state_bytes


def _vocab_and_casts():
    """The default tier takes each cast once, with the small and the large vocabulary;
    the slow tier adds the other two pairings."""
    for vocab, autocast_bf16 in ((VOCAB, False), (8192, True), (VOCAB, True), (8192, False)):
        marks = () if (vocab == 8192) == autocast_bf16 else (pytest.mark.slow,)
        yield pytest.param(vocab, autocast_bf16, marks=marks,
                           id=f"{vocab}-{'bf16-autocast' if autocast_bf16 else 'fp32'}")


@pytest.mark.parametrize("vocab, autocast_bf16", list(_vocab_and_casts()))
@pytest.mark.parametrize("size, stages, stage", list(splits()))
def test_activation_part_bounds_a_measured_micro_batch(gen, vocab, autocast_bf16, size, stages, stage):
    """The peak that one micro-batch's recomputed forward and backward allocates, bf16
    autocast measured through the CPU's autocast (the same casts as CUDA's for this
    model). The estimate may be up to a fifth high (bf16 gradient temporaries are
    smaller than the fp32 ones it assumes), never low."""
    spec = RunSpec(model_size=size, num_stages=stages, batch_size=BATCH, seq_len=SEQ)
    worker = StageWorker(spec, stage, vocab)
    worker.autocast_dtype = torch.bfloat16 if autocast_bf16 else None
    inputs, run = _one_micro_batch(worker, gen)
    run()  # gradients exist from here on; later micro-batches add into them
    tracker = PeakAllocation([*worker.params, *(p.grad for p in worker.params), *worker.stage.buffers(),
                              *inputs])
    with tracker:
        run()
    estimate = estimate_stage_memory(worker.model_config, num_stages=stages, stage_index=stage,
                                     batch_size=BATCH,
                                     seq_len=SEQ, autocast_bf16=autocast_bf16)
    assert 0.8 * estimate.activation_bytes <= tracker.peak <= estimate.activation_bytes, \
        f"measured {tracker.peak} bytes against an estimate of {estimate.activation_bytes}"


@pytest.mark.parametrize("autocast_bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("size, stages", [("debug", 2), ("tiny", 1)])
def test_the_chunked_loss_fits_its_estimate(gen, autocast_bf16, size, stages):
    """The last stage with its loss in chunks of 32 tokens (model/loss.py): the logits of
    one chunk, not of the micro-batch, are in the estimate."""
    vocab, chunk_logits = 8192, 32 * 8192
    spec = RunSpec(model_size=size, num_stages=stages, batch_size=BATCH, seq_len=SEQ)
    worker = StageWorker(spec, stages - 1, vocab)
    worker.autocast_dtype = torch.bfloat16 if autocast_bf16 else None
    worker.stage.loss_chunk_logits = chunk_logits
    inputs, run = _one_micro_batch(worker, gen)
    run()
    tracker = PeakAllocation([*worker.params, *(p.grad for p in worker.params), *worker.stage.buffers(),
                              *inputs])
    with tracker:
        run()
    estimate = estimate_stage_memory(worker.model_config, num_stages=stages, stage_index=stages - 1,
                                     batch_size=BATCH, seq_len=SEQ, autocast_bf16=autocast_bf16,
                                     loss_chunk_logits=chunk_logits)
    plain = estimate_stage_memory(worker.model_config, num_stages=stages, stage_index=stages - 1,
                                  batch_size=BATCH,
                                  seq_len=SEQ, autocast_bf16=autocast_bf16, loss_chunk_logits=None)
    assert (
        0.8 * estimate.activation_bytes <= tracker.peak <= estimate.activation_bytes < plain.activation_bytes
    ), f"measured {tracker.peak} bytes against an estimate of {estimate.activation_bytes}"


@pytest.mark.parametrize("partner", [False, True], ids=["local-only", "pair"])
@pytest.mark.parametrize("size, stages, stage", [("debug", 2, 0), ("tiny", 3, 1), ("tiny", 2, 1)])
def test_outer_step_part_bounds_a_measured_round(gen, partner, size, stages, stage):
    """Never low; up to 40 % high where one tensor is a large share of the stage (the
    debug embedding is 38 % of stage 0): the estimate takes its temporaries at their
    worst, with every new phi and momentum already built."""
    spec = RunSpec(model_size=size, num_stages=stages, batch_size=BATCH, seq_len=SEQ)
    worker = StageWorker(spec, stage, VOCAB)
    with torch.no_grad():
        for p in worker.params:
            p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
    # arrives on the CPU
    other = ([t.half() for t in worker.slow.phi], [t.half() for t in worker.slow.deltas()])
    opened = worker.open_round()  # what it keeps is resident while the round runs: counted in the state
    tracker = PeakAllocation([*worker.params, *worker.slow.phi, *worker.slow.momentum, *other[0], *other[1],
                              *opened.wire])
    with tracker:
        worker.close_round([other] if partner else [])
    estimate = estimate_stage_memory(worker.model_config, num_stages=stages, stage_index=stage,
                                     batch_size=BATCH,
                                     seq_len=SEQ, autocast_bf16=False)
    assert 0.6 * estimate.outer_step_bytes <= tracker.peak <= estimate.outer_step_bytes, \
        f"measured {tracker.peak} bytes against an estimate of {estimate.outer_step_bytes}"


def test_simulator_need_counts_every_worker_once():
    from swarm_node.data import DataSpec
    from swarm_node.optim import InnerHyper
    from swarm_node.sim import SimConfig

    config = SimConfig(method=default_method("noloco"), inner=InnerHyper(), data=DataSpec(), replicas=3,
                       stages=2,
                       model_size="tiny", seq_len=SEQ, batch_size=BATCH)
    model = model_config("tiny", vocab_size=VOCAB, max_seq_len=SEQ)
    per_stage = [estimate_stage_memory(model, num_stages=2, stage_index=s, batch_size=BATCH, seq_len=SEQ,
                                       autocast_bf16=False) for s in range(2)]
    need = simulator_memory(config, model)
    assert need.parameters == 3 * model.num_parameters()
    assert need.state_bytes == 3 * 40 * model.num_parameters()  # an upper bound: a round under way included
    assert need.activation_bytes == sum(m.activation_bytes for m in per_stage)


def test_table_covers_every_size_and_marks_impossible_splits():
    table = memory_table(vocab_size=VOCAB, batch_size=BATCH, seq_len=SEQ).splitlines()
    assert len(table) == 2 + len(NAMED_SIZES)
    debug = next(line for line in table if line.startswith("| debug"))
    assert debug.endswith("| n/a |")  # 2 layers do not split into 4 stages
    large = next(line for line in table if line.startswith("| large"))
    assert "GiB" in large and "n/a" not in large


def test_the_volunteers_guide_tables_are_what_the_code_computes():
    """The volunteers' guide's memory and link figures come from swarm_node/model/memory.py
    and links.py (`python -m swarm_node.model.memory`, `python -m swarm_node.model.links`),
    not by hand: a change to the estimate must be pasted into the guide."""
    from pathlib import Path

    from swarm_node.model.links import activation_table, round_table, uplink_table

    guide = (Path(__file__).resolve().parents[2] / "docs" / "VOLUNTEERS.md").read_text()
    for table in (memory_table(), round_table(), activation_table(), uplink_table()):
        assert table in guide, table


def test_the_largest_micro_batch_a_card_holds_fits_and_twice_it_does_not(capsys):
    card = 80 << 30
    for size, stages in (("small", 1), ("medium", 1), ("medium", 2)):
        config = model_config(size, vocab_size=256, max_seq_len=1024)
        batch = largest_micro_batch(config, num_stages=stages, seq_len=1024, card_bytes=card)

        def need(b, config=config, stages=stages):
            return largest_stage_memory(config, num_stages=stages, batch_size=b, seq_len=1024,
                                        autocast_bf16=True)[1].peak_bytes + CARD_RESERVE_BYTES

        assert need(batch) <= card < need(2 * batch), (size, stages, batch)
    large = model_config("large", vocab_size=256, max_seq_len=1024)
    assert largest_micro_batch(large, num_stages=1, seq_len=1024, card_bytes=card) is None
    main(["--card-gib", "24", "--vocab", "256"])
    out = capsys.readouterr().out
    assert "largest micro-batch a 24 GiB card holds" in out and "samples_per_step" in out


def test_the_vocabulary_table_grows_with_the_vocabulary_and_is_the_readme_s(capsys):
    """What a vocabulary costs a stage (issue 56): each column the largest of 2 stages at
    one vocabulary, the data guide's table made by the same code."""
    from pathlib import Path

    from swarm_node.model.memory import VOCABULARIES, vocab_table

    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    table = vocab_table()
    rows = table.splitlines()[2:]
    assert [r.split(" | ")[0].removeprefix("| ") for r in rows] == list(NAMED_SIZES)
    for row in rows:
        cells = [c.strip() for c in row.strip("| ").split(" | ")[1:]]
        assert len(cells) == len(VOCABULARIES)
        peaks = [float(c.split()[0]) * units[c.split()[1]] for c in cells]
        assert peaks == sorted(peaks) and peaks[0] < peaks[-1], row
    small = model_config("small", vocab_size=50_257, max_seq_len=1024)
    _, need = largest_stage_memory(small, num_stages=2, batch_size=8, seq_len=1024, autocast_bf16=True)
    assert (
        next(r for r in rows if r.startswith("| small")).split(" | ")[4]
        == f"{need.peak_bytes / 2**30:.1f} GiB"
    )
    assert table in (Path(__file__).resolve().parents[2] / "docs" / "DATA.md").read_text()
    main(["--vocab-costs"])
    assert table in capsys.readouterr().out

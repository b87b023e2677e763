"""``--compile`` (train/compiled.py): the flag reaches the node's worker, every block is
compiled in place and warmed up without a trace, a failure is one line saying what to
change; and (slow tier, inductor on the CPU) a compiled stage computes what the eager
one does."""

import pytest
import torch

from swarm_node.cli import main as cli
from swarm_node.errors import SwarmError
from swarm_node.spec import RunSpec
from swarm_node.train import compiled
from swarm_node.train.worker import StageWorker

SPEC = RunSpec(model_size="debug", num_stages=2, batch_size=2, seq_len=16, samples_per_step=2)


class Built(SwarmError):
    """Raised from on_node: the node was built, nothing needs to run."""


def test_join_compile_reaches_the_node_config(tmp_path):
    SPEC.write_json(tmp_path / "spec.json")
    seen = []

    def on_node(node):
        seen.append(node.config.compile_stage)
        raise Built("built")

    for flags in ((), ("--compile",)):
        assert cli.main(["join", "--config", str(tmp_path / "spec.json"), "--device", "cpu", "--no-progress",
                         *flags], on_node=on_node) == 2
    assert seen == [False, True]


def compiled_worker(spec: RunSpec, stage: int, vocab: int) -> StageWorker:
    """What the node does with --compile: the worker, then its blocks compiled."""
    worker = StageWorker(spec, stage, vocab)
    compiled.compile_stage(worker)
    return worker


@pytest.fixture
def recorded_compiles(monkeypatch):
    """nn.Module.compile recorded instead of run: no torch._dynamo in the default tier."""
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: calls.append((self, kwargs)))
    return calls


@pytest.mark.parametrize("stage", [0, 1])
def test_every_block_is_compiled_in_place_and_the_warm_up_leaves_no_trace(recorded_compiles, stage):
    worker = compiled_worker(SPEC, stage, 32)
    assert [block for block, _ in recorded_compiles] == list(worker.stage.model.layers.values())
    assert all(kwargs == {"dynamic": False} for _, kwargs in recorded_compiles)
    assert worker.compile_s > 0
    assert all(p.grad is None for p in worker.params)
    assert worker.inner_step == 0 and worker.pending_samples == 0 and worker.training_s == 0
    plain = StageWorker(SPEC, stage, 32)
    assert all(torch.equal(a, b) for a, b in zip(worker.params, plain.params))  # nothing stepped


def test_a_compile_failure_is_one_line_that_says_what_to_change(monkeypatch, recorded_compiles):
    def broken(worker):
        raise RuntimeError("InductorError: C++ compile error\nlong trace ...")

    monkeypatch.setattr(compiled, "warm_up", broken)
    with pytest.raises(compiled.CompileFailed) as failed:
        compiled_worker(SPEC, 0, 32)
    message = str(failed.value)
    assert (
        "\n" not in message and message.endswith("run without --compile") and "C++ compile error" in message
    )


def test_out_of_memory_while_compiling_stays_out_of_memory(monkeypatch, recorded_compiles):
    def full(worker):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(compiled, "warm_up", full)
    with pytest.raises(torch.OutOfMemoryError):  # the node's compute thread explains it
        compiled_worker(SPEC, 0, 32)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_compiled_stage_computes_what_the_eager_one_does():
    """Inductor on the CPU (gcc): minutes on a loaded 2-core machine, hence the slow tier."""
    eager = [StageWorker(SPEC, s, 64) for s in range(2)]
    fast = [compiled_worker(SPEC, s, 64) for s in range(2)]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens, targets = torch.randint(64, (2, 16), generator=g), torch.randint(64, (2, 16), generator=g)
        outputs = []
        for first, last in (eager, fast):
            hidden = first.forward(tokens)
            loss, grad = last.forward_backward_last(hidden, targets)
            first.backward(tokens, grad)
            outputs.append((hidden, loss, grad))
            first.step(), last.step()
        (h_a, loss_a, g_a), (h_b, loss_b, g_b) = outputs
        torch.testing.assert_close(h_b, h_a, rtol=1e-4, atol=1e-5)
        assert loss_b == pytest.approx(loss_a, rel=1e-5)
        torch.testing.assert_close(g_b, g_a, rtol=1e-4, atol=1e-6)
    for a, b in zip(eager, fast):
        for p, q in zip(a.params, b.params):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    assert list(fast[1].stage.state_dict()) == list(eager[1].stage.state_dict())

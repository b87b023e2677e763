"""Device choice, training precision and out-of-memory messages. No GPU is needed: the
CUDA and MPS queries are replaced by fakes that answer as the named cards do."""

import logging
import warnings
from types import SimpleNamespace

import pytest
import torch

from swarm_node.config import resolve_device
from swarm_node.errors import ConfigError
from swarm_node.model.config import model_config
from swarm_node.model.memory import estimate_stage_memory, format_bytes
from swarm_node.optim import InnerHyper, default_method
from swarm_node.optim.inner import InnerOptimizer
from swarm_node.optim.outer import _float64_device, group_mean
from swarm_node.spec import RunSpec
from swarm_node.train import device as device_module
from swarm_node.train.device import (
    OutOfMemory,
    autocast,
    autocast_dtype,
    device_facts,
    explain_oom,
    is_out_of_memory,
    oom_explained,
    training_precision,
)
from swarm_node.train.worker import StageWorker

GiB = 1 << 30
CARDS = {  # name, capability, memory
    "GTX 1080": ("NVIDIA GeForce GTX 1080", (6, 1), 8 * GiB),
    "V100": ("Tesla V100-SXM2-16GB", (7, 0), 16 * GiB),
    "T4": ("Tesla T4", (7, 5), 15 * GiB),
    "RTX 2080": ("NVIDIA GeForce RTX 2080", (7, 5), 8 * GiB),
    "A100": ("NVIDIA A100-SXM4-40GB", (8, 0), 40 * GiB),
    "RTX 3090": ("NVIDIA GeForce RTX 3090", (8, 6), 24 * GiB),
    "H100": ("NVIDIA H100 80GB HBM3", (9, 0), 80 * GiB),
}


def fake_cuda(monkeypatch, card: str, count: int = 1):
    """torch.cuda answering as ``count`` cards of kind ``card``; records which index was asked."""
    name, (major, minor), memory = CARDS[card]
    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(name=name, major=major, minor=minor, total_memory=memory)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, minor))
    # Emulated bf16 counts as "supported" here on every card: the choice must not rely on it.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    return asked


def fake_mps(monkeypatch, available: bool, built: bool = True):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: available)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: built)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 21 * GiB)


# -- resolve_device ---------------------------------------------------------------------

@pytest.mark.parametrize("cuda, mps, want", [(True, True, "cuda"), (False, True, "mps"), (False, False,
                                                                                          "cpu")])
def test_auto_prefers_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    fake_mps(monkeypatch, available=mps)
    assert resolve_device("auto") == want


def test_mps_is_accepted_when_available(monkeypatch):
    fake_mps(monkeypatch, available=True)
    assert resolve_device("mps") == "mps"


@pytest.mark.parametrize("built, why", [(True, "no usable Apple GPU"), (False, "no MPS support")])
def test_mps_when_absent_says_why_and_what_to_use(monkeypatch, built, why):
    fake_mps(monkeypatch, available=False, built=built)
    with pytest.raises(ConfigError, match=f"{why}.*use --device cpu"):
        resolve_device("mps")


def test_cuda_index_must_exist(monkeypatch):
    fake_cuda(monkeypatch, "T4", count=2)
    assert resolve_device("cuda") == "cuda"
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ConfigError, match="sees 2 CUDA device.*cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_cuda_without_cuda_and_unknown_names_are_config_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device; use --device cpu"):
        resolve_device("cuda:0")
    for name in ("tpu", "cuda:x", "cudax", "gpu"):
        with pytest.raises(ConfigError, match="use auto, cpu, cuda, cuda:N or mps"):
            resolve_device(name)
    assert issubclass(ConfigError, ValueError)  # callers that caught ValueError still do


# -- precision --------------------------------------------------------------------------

@pytest.mark.parametrize("card, want", [("GTX 1080", None), ("V100", None), ("T4", None), ("RTX 2080", None),
                                        ("A100", torch.bfloat16), ("RTX 3090", torch.bfloat16),
                                        ("H100", torch.bfloat16)])
def test_bf16_autocast_only_from_compute_capability_8(monkeypatch, card, want):
    fake_cuda(monkeypatch, card)
    assert autocast_dtype(device_facts("cuda")) is want


def test_facts_come_from_the_chosen_card(monkeypatch):
    asked = fake_cuda(monkeypatch, "A100", count=2)
    facts = device_facts("cuda:1")
    assert (facts.device, facts.name, facts.capability, facts.total_memory_bytes) == \
        ("cuda:1", "NVIDIA A100-SXM4-40GB", (8, 0), 40 * GiB)
    assert asked == [1]


def test_mps_and_cpu_train_in_fp32(monkeypatch):
    fake_mps(monkeypatch, available=True)
    mps = device_facts("mps")
    assert (mps.name, mps.total_memory_bytes) == ("Apple GPU (MPS)", 21 * GiB)
    assert autocast_dtype(mps) is None
    assert autocast_dtype(device_facts("cpu")) is None


@pytest.mark.parametrize("card, words", [("T4", ["Tesla T4", "compute capability 7.5", "15.0 GiB", "fp32",
                                                  "bf16 needs compute capability 8.0"]),
                                         ("A100", ["NVIDIA A100-SXM4-40GB", "compute capability 8.0",
                                                   "40.0 GiB", "bf16 autocast"])])
def test_precision_is_logged_once_per_device(monkeypatch, caplog, card, words):
    fake_cuda(monkeypatch, card)
    monkeypatch.setattr(device_module, "_announced", set())
    with caplog.at_level(logging.INFO, logger="swarm_node.train.device"):
        first = training_precision("cuda:0")
        again = training_precision(torch.device("cuda", 0))
    assert first is again
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0]
    for word in words:
        assert word in lines[0]


def test_autocast_context_follows_the_choice():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this torch has no CUDA and says so when asked to autocast there
        context = autocast(torch.device("cuda:0"), torch.bfloat16)
    assert isinstance(context, torch.autocast)
    assert (context.device, context.fast_dtype) == ("cuda", torch.bfloat16)
    assert not isinstance(autocast(torch.device("cuda:0"), None), torch.autocast)
    assert not isinstance(autocast(torch.device("mps"), None), torch.autocast)


def test_worker_autocasts_in_the_dtype_chosen_for_its_device(monkeypatch):
    spec = RunSpec(model_size="debug", num_stages=1)
    assert StageWorker(spec, 0, 32).autocast_dtype is None  # the CPU: fp32
    seen = []
    monkeypatch.setattr("swarm_node.train.worker.training_precision",
                        lambda device: seen.append(torch.device(device)) or torch.bfloat16)
    worker = StageWorker(spec, 0, 32)
    assert seen == [torch.device("cpu")]
    with worker.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    tokens = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, _ = worker.forward_backward_last(None, tokens, tokens)
    assert torch.isfinite(torch.tensor(loss))


# -- MPS-safe optimizer paths ----------------------------------------------------------------

def test_group_means_accumulate_in_float64_on_the_cpu_for_mps():
    assert _float64_device(torch.device("mps")) == torch.device("cpu")
    assert _float64_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert _float64_device(torch.device("cpu")) == torch.device("cpu")


def test_group_mean_is_unchanged_on_the_cpu(gen):
    members = [torch.randn(5, 7, generator=gen) for _ in range(3)] + [torch.randn(5, 7, generator=gen).half()]
    before = (sum(t.to(torch.float64) for t in members) / len(members)).to(torch.float32)
    assert torch.equal(group_mean(members), before)


def test_outer_step_from_wire_values_is_bit_identical_to_widening_them_first(gen):
    spec = RunSpec(model_size="debug", num_stages=2)
    workers = [StageWorker(spec, 1, 32) for _ in range(2)]
    with torch.no_grad():
        for p in workers[0].params:
            p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
    workers[1].open_round()
    partner = workers[1].own_payload()
    workers[0].open_round()
    own = workers[0].own_payload()
    reference = StageWorker(spec, 1, 32)
    reference.load_snapshot(0, 0, workers[0].snapshot()["tensors"])
    workers[0].close_round([partner])
    members = [own, partner]
    reference.slow.apply([[t.float() for t in phi] for phi, _ in members],
                         [[t.float() for t in delta] for _, delta in members])
    assert workers[0].theta_digest() == reference.theta_digest()


def test_clipping_works_where_torch_has_no_foreach_kernels(monkeypatch, gen):
    """MPS has none; foreach=True made the inner step raise there."""
    def optimizer_after_one_step():
        params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(2)]
        for p in params:
            p.grad = torch.full_like(p, 5.0)
        inner = InnerOptimizer(params, InnerHyper(lr=0.1, warmup_steps=0, total_steps=10, clip_norm=1.0))
        return inner.step(), params

    norm_foreach, _ = optimizer_after_one_step()
    from torch.nn.utils import clip_grad

    monkeypatch.setattr(clip_grad, "_device_has_foreach_support", lambda device: False)
    monkeypatch.setattr(clip_grad, "_has_foreach_support", lambda tensors, device: False)
    norm, params = optimizer_after_one_step()
    assert norm == pytest.approx(norm_foreach)
    assert all(torch.isfinite(p).all() for p in params)


# -- out of memory ---------------------------------------------------------------------------

CUDA_OOM = torch.OutOfMemoryError(
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "14.58 GiB of which 1.06 GiB is free."
)
MPS_OOM = RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.2 GB, max "
                       "allowed: 18.13 GB). Tried to allocate 256.00 MB on private pool.")


def test_out_of_memory_is_recognised_and_nothing_else():
    assert is_out_of_memory(CUDA_OOM) and is_out_of_memory(MPS_OOM)
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("MPS backend out of memory"))


def test_cuda_oom_names_model_stage_device_need_and_remedies(monkeypatch):
    fake_cuda(monkeypatch, "T4")
    error = explain_oom(CUDA_OOM, model_size="medium", stage=1, num_stages=2, device="cuda",
                        vocab_size=32_000,
                        batch_size=8, seq_len=1024)
    assert isinstance(error, OutOfMemory)
    message = str(error)
    # The T4 trains in fp32, so the estimate is the fp32 one.
    need = estimate_stage_memory(model_config("medium", vocab_size=32_000, max_seq_len=1024), num_stages=2,
                                 stage_index=1, batch_size=8, seq_len=1024, autocast_bf16=False)
    for part in ("out of memory on cuda:0", "Tesla T4", "15.0 GiB in all", "stage 1 of 2 of the medium model",
                 f"needs about {format_bytes(need.peak_bytes)}", "8 x 1024-token micro-batches",
                 "a smaller model", "more pipeline stages", "batch_size or seq_len", "--device cpu"):
        assert part in message, part
    assert "\n" not in message


def test_mps_oom_uses_the_recommended_working_set(monkeypatch):
    fake_mps(monkeypatch, available=True)
    message = str(explain_oom(MPS_OOM, model_size="small", stage=0, num_stages=1, device="mps",
                              vocab_size=256,
                              batch_size=8, seq_len=256))
    assert "out of memory on mps (Apple GPU (MPS), 21.0 GiB in all)" in message and "--device cpu" in message


def test_cpu_oom_does_not_suggest_the_cpu():
    oom = RuntimeError(
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes."
    )
    message = str(explain_oom(oom, model_size="tiny", stage=0, num_stages=1, device="cpu", vocab_size=256,
                              batch_size=8, seq_len=256))
    assert message.startswith("out of memory on cpu") and "--device cpu" not in message


def test_other_errors_are_not_explained():
    assert explain_oom(RuntimeError("boom"), model_size="tiny", stage=0, num_stages=1, device="cpu",
                       vocab_size=256, batch_size=8, seq_len=256) is None


def test_context_manager_converts_oom_and_passes_everything_else(monkeypatch):
    fake_cuda(monkeypatch, "A100")
    spec = RunSpec(model_size="small", num_stages=4, batch_size=4, seq_len=512,
                   method=default_method("local"))
    with pytest.raises(OutOfMemory, match="stage 3 of 4 of the small model") as caught:
        with oom_explained(spec, stage=3, vocab_size=32_000, device="cuda:0"):
            raise CUDA_OOM
    assert caught.value.__cause__ is CUDA_OOM
    need = estimate_stage_memory(model_config("small", vocab_size=32_000, max_seq_len=512), num_stages=4,
                                 stage_index=3, batch_size=4, seq_len=512, autocast_bf16=True,
                                 outer_state=False)
    assert f"needs about {format_bytes(need.peak_bytes)}" in str(caught.value)
    with pytest.raises(KeyError), oom_explained(spec, stage=3, vocab_size=32_000, device="cuda:0"):
        raise KeyError("not memory")


def test_simulator_explains_oom_while_building_and_training(monkeypatch):
    from swarm_node.data import DataSpec
    from swarm_node.sim import SimConfig, Simulator
    from swarm_node.sim.simulator import simulator_memory

    config = SimConfig(method=default_method("noloco", inner_steps=2),
                       inner=InnerHyper(warmup_steps=1, total_steps=4),
                       data=DataSpec(kind="synthetic", order=1, num_tokens=20_000), replicas=2, stages=2,
                       seq_len=32, batch_size=4, steps=4, eval_batches=1)
    sim = Simulator(config)
    need = format_bytes(simulator_memory(config, sim.model_config).peak_bytes)

    def out_of_memory(*args, **kwargs):
        raise CUDA_OOM

    monkeypatch.setattr(Simulator, "train_step", out_of_memory)
    with pytest.raises(OutOfMemory, match=f"2 replicas x 2 stages of the debug model.*needs about {need}.*"
                                          "fewer --replicas"):
        sim.run()
    monkeypatch.setattr(Simulator, "_build_worker", out_of_memory)
    with pytest.raises(OutOfMemory, match="out of memory on cpu"):
        Simulator(config)
    monkeypatch.setattr(Simulator, "_build_worker", lambda self, stage: {}[stage])
    with pytest.raises(KeyError):
        Simulator(config)

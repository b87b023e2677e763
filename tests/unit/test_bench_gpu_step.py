"""bench.gpu_step without a GPU: it refuses in one line, its FLOP count and peak table
against hand-computed values, and the CPU smoke run end to end (result, plot, section)."""

import json

import pytest
import torch

from bench.gpu_step import benchmark
from bench.gpu_step.report import markdown
from swarm_node.spec import RunSpec


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_it_refuses_in_one_line(tmp_path, capsys):
    assert benchmark.main(["--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err and "--device cpu --quick" in err
    assert not list(tmp_path.iterdir())


def test_model_flops_per_token_of_each_stage():
    h, ffn, layers, vocab, seq = 768, 2048, 12, 256, 1024  # small
    per_layer = 4 * h * h + 3 * h * ffn  # q, k, v, o and the SwiGLU's three (norms hold no matmul)
    whole = benchmark.flops_per_token(RunSpec(model_size="small", num_stages=1, seq_len=seq), 0, vocab)
    assert whole == 6 * (layers * per_layer + vocab * h) + 12 * layers * h * seq
    split = RunSpec(model_size="small", num_stages=2, seq_len=seq)
    first, last = benchmark.flops_per_token(split, 0, vocab), benchmark.flops_per_token(split, 1, vocab)
    assert first == 6 * 6 * per_layer + 12 * 6 * h * seq  # the embedding lookup is no matmul
    assert first + last == whole


def test_spec_sheet_peaks_by_card_name():
    assert benchmark.spec_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert benchmark.spec_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert benchmark.spec_peak_tflops("NVIDIA H200") == 989.4
    assert benchmark.spec_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert benchmark.spec_peak_tflops("Some Future Card") is None


def test_the_cpu_smoke_run_writes_a_result_the_report_renders(tmp_path, capsys):
    assert benchmark.main(["--device", "cpu", "--quick", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_step.json").read_text())
    assert result["benchmark"] == "gpu_step" and result["mode"] == "smoke"
    rows = result["rows"]
    assert {(r["stages"], r["stage"], r["mode"]) for r in rows} == {
        (1, 0, "baseline"), (1, 0, "fused"), (2, 0, "baseline"), (2, 0, "fused"), (2, 1, "baseline"),
        (2, 1, "fused")}
    for row in rows:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu_measured"] and row["estimate_bytes"] > 0
        assert (row["loss"] is not None) == (row["stage"] == row["stages"] - 1)
    assert result["summary"]["pipeline_tokens_per_s"]["debug/2"]["speedup"] > 0
    text = markdown(result)
    assert "| debug | 256 | 2 | 1 | fused |" in text and "debug/2" in text
    assert "fused" in capsys.readouterr().out  # one line per measurement as it goes

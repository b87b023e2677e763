"""From a folder of text to a run in one command (issue 56): on the host, `swarm-node data
prepare text:DIR --out DATA --train-tokenizer 8192` trains a BPE tokenizer and prepares
the shards, no other tool involved; the bootstrap serves them, and two volunteers with
nothing but the printed line train, each on a model the 8,192-token vocabulary sizes and
with the tokenizer the host trained."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from swarm_hosts import VENV_BIN, BootstrapOnHost, Volunteer, run_spec_file, volunteer_env, wait_for

from swarm_node.model.config import model_config
from swarm_node.model.memory import stage_parameters

pytestmark = pytest.mark.timeout(900)

VOCAB = 8192


def _folder_of_text(workdir: Path) -> Path:
    """The bundled docstrings as text files (about 560 kB: enough text for 8,192 tokens)."""
    from swarm_node.data.dataset import corpus_documents

    docs = workdir / "docs"
    docs.mkdir()
    for i, part in enumerate(corpus_documents()):
        (docs / f"module-{i:03d}.txt").write_text(part[:40_000])
    return docs


def test_two_volunteers_train_on_a_folder_of_text_prepared_in_one_command(bed, tmp_path):
    host = bed.add_host("boot")
    docs, data, log = _folder_of_text(tmp_path), tmp_path / "data", tmp_path / "prepare.log"
    command = [str(VENV_BIN / "swarm-node"), "data", "prepare", f"text:{docs}", "--out", str(data),
               "--train-tokenizer", str(VOCAB), "--shard-tokens", "16384", "--chunk-kb", "16",
               "--no-progress"]
    prepared = bed.popen(host, command, cwd=tmp_path, env=volunteer_env(), log=log)
    assert prepared.wait(timeout=300) == 0, log.read_text()
    printed = log.read_text()
    assert f"vocabulary {VOCAB}," in printed, printed
    digest = re.search(r'manifest_sha256 = "([0-9a-f]{64})"', printed).group(1)
    spec = run_spec_file(tmp_path, run_id="one-command")
    spec.write_text(re.sub(r"(?ms)^\[data\].*?(?=^\[method\])",
                           f'[data]\nkind = "manifest"\nmanifest_sha256 = "{digest}"\n\n', spec.read_text()))

    boot = BootstrapOnHost(bed, host, tmp_path, "--run-spec", str(spec), "--data", str(data))
    line = boot.join_line()
    volunteers = [Volunteer(bed, bed.add_host(f"v{i}"), tmp_path, line) for i in range(2)]

    def both_train() -> bool:
        peers = boot.peers()
        return len(peers) == 2 and all(p["verified"] and p["state"] == "training" and p["inner_step"] >= 3
                                       for p in peers)

    wait_for(both_train, 420, "both volunteers to train", tmp_path)
    model = model_config("debug", vocab_size=VOCAB, max_seq_len=64)
    stages = set()
    for v in volunteers:
        found = re.search(r"node \w+: stage (\d) of 2, (\d+) parameters", v.text())
        assert found, v.text()[-3000:]
        stage = int(found.group(1))
        stages.add(stage)
        assert int(found.group(2)) == stage_parameters(model, num_stages=2, stage_index=stage), v.host.name
        fetched = v.workdir / "cache" / "swarm-node" / "data" / digest[:16] / "tokenizer.json"
        assert fetched.read_bytes() == (data / "tokenizer.json").read_bytes(), v.host.name
        if stage == 0:
            assert re.search(r"data: training shard-\d+\.tok", v.text()), v.text()[-3000:]
    assert stages == {0, 1}

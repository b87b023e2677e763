"""The tokenizer a prepared dataset is made with (issue 56): a byte-level BPE that `data
prepare --train-tokenizer` trains on the source (deterministic, listed in the manifest,
not trained again by a rerun), or a published one named from the local Hugging Face
cache; the manifest's vocabulary then sizes the model of every kind of run."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from swarm_node.cli.main import main as cli_main
from swarm_node.data import bpe
from swarm_node.data import prepare as prepare_module
from swarm_node.data.dataset import corpus_documents, load_windows
from swarm_node.data.manifest import local_manifest_sha256, sha256_hex
from swarm_node.data.prepare import PrepareConfig, prepare
from swarm_node.data.shard_format import open_shard
from swarm_node.data.spec import DataSpec
from swarm_node.data.tokenizer import HFTokenizer

pytest.importorskip("tokenizers")

REVISION = "4f6c9a0e1b2d3c4e5f60718293a4b5c6d7e8f901"


def _prepare(source: str, out: Path, **options):
    options = {"source": source, "out_dir": out, "shard_tokens": 8192, "chunk_bytes": 16 << 10,
               "progress": False, **options}
    return prepare(PrepareConfig(**options))


def _tokens(out: Path, manifest) -> np.ndarray:
    return np.concatenate([open_shard(out / e.name, vocab_size=manifest.vocab_size)
                           for e in manifest.train + manifest.val])


def _text_dir(root: Path, docs: int = 8) -> Path:
    folder = root / "text"
    folder.mkdir(parents=True)
    for i, part in enumerate(corpus_documents()[:docs]):
        (folder / f"doc-{i:02d}.txt").write_text(part[:30_000])
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The bundled corpus prepared with a BPE of 1,024 tokens trained on it."""
    out = tmp_path_factory.mktemp("trained")
    manifest, digest = _prepare("corpus", out, train_vocab=1024, shard_tokens=100_000, chunk_bytes=64 << 10)
    return out, manifest, digest


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache of the test's own (HF_HOME), read with no network."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def _cache_model(hub: Path, repo: str, tokenizer_json: bytes) -> None:
    """``repo`` as Hugging Face programs leave a download in their cache: the file as a
    blob, the snapshot of a revision linking to it, refs/main naming the revision."""
    root = hub / f"models--{repo.replace('/', '--')}"
    blob = root / "blobs" / hashlib.sha256(tokenizer_json).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(tokenizer_json)
    snapshot = root / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to(Path("..", "..", "blobs", blob.name))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REVISION)


# -- training -----------------------------------------------------------------------------
def test_a_trained_bpe_is_listed_in_the_manifest_and_ends_every_document(trained):
    out, manifest, _ = trained
    tokenizer = HFTokenizer(out / "tokenizer.json")
    assert manifest.vocab_size == tokenizer.vocab_size == 1024 and manifest.dtype == "u16"
    assert manifest.tokenizer.name == "tokenizer.json"
    assert manifest.tokenizer.sha256 == sha256_hex((out / "tokenizer.json").read_bytes())
    end = tokenizer.end_of_text
    assert end == tokenizer._tokenizer.token_to_id(bpe.END_OF_TEXT)
    tokens = _tokens(out, manifest)
    docs = corpus_documents()
    ends = np.flatnonzero(tokens == end)
    assert len(ends) == len(docs) and ends[-1] == len(tokens) - 1  # one after each document, nothing else
    assert tokenizer.decode(tokens[:ends[0]].tolist()) == docs[0]  # byte-level: the text comes back whole
    assert tokenizer.decode(tokens[ends[-2] + 1:ends[-1]].tolist()) == docs[-1]
    spelled = tokenizer.encode_document(f"a {bpe.END_OF_TEXT} b")  # text that spells the token is text
    assert spelled.count(end) == 1 and spelled[-1] == end


def test_the_manifest_vocabulary_sizes_the_model_of_a_node_of_local_and_of_sim(trained):
    from swarm_node.data.source import RunData
    from swarm_node.optim import InnerHyper, default_method
    from swarm_node.sim import SimConfig
    from swarm_node.sim.simulator import Simulator
    from swarm_node.spec import RunSpec

    out, manifest, _ = trained
    data = DataSpec.parse(f"manifest:{out}")
    # A node (join, and each node of `local`): StageWorker is built with what RunData.open returns.
    node_data = RunData(RunSpec(data=data), cache_dir=out / "unused", cache_gb=None, initial_peers=[],
                        peers=list,
                        on_fault=lambda peer, why: None, progress=False)

    async def open_then_close() -> int:
        try:
            return await node_data.open(None, asyncio.to_thread)
        finally:
            await node_data.close()

    assert asyncio.run(open_then_close()) == 1024
    # `local`'s final evaluation and `sim` read the folder whole.
    assert load_windows(data, seq_len=32).vocab_size == 1024
    sim = Simulator(SimConfig(method=default_method("noloco"), inner=InnerHyper(), data=data, replicas=1,
                              stages=2, seq_len=32, batch_size=2, steps=1))
    assert sim.model_config.vocab_size == 1024
    first, last = sim.workers[0][0].stage, sim.workers[1][0].stage
    assert first.model.embed_tokens.num_embeddings == 1024 and last.lm_head.out_features == 1024


def test_the_same_source_and_options_prepared_twice_give_the_same_manifest(tmp_path):
    """Two processes, one trainer thread and four, one with progress bars: the same
    tokenizer and manifest, and the command's output holds only its summary."""
    text = _text_dir(tmp_path)
    digests = []
    for run, (threads, bars) in enumerate((("1", []), ("4", ["--no-progress"]))):
        out = tmp_path / f"out{run}"
        done = subprocess.run([sys.executable, "-m", "swarm_node", "data", "prepare", f"text:{text}", "--out",
                               str(out), "--train-tokenizer", "2000", "--shard-tokens", "8192", *bars],
                              env={**os.environ, "RAYON_NUM_THREADS": threads,
                                   "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("prepared "), done.stdout[:300]
        digests.append(re.search(r'manifest_sha256 = "([0-9a-f]{64})"', done.stdout).group(1))
        assert digests[-1] == local_manifest_sha256(out)
    assert digests[0] == digests[1]
    assert (tmp_path / "out0" / "tokenizer.json").read_bytes() == (
        tmp_path / "out1" / "tokenizer.json"
    ).read_bytes()


def test_a_rerun_does_not_train_again_but_an_edited_source_does(tmp_path, monkeypatch):
    text = _text_dir(tmp_path)
    trainings = []
    real_train = bpe.train_bpe
    monkeypatch.setattr(bpe, "train_bpe", lambda *a, **k: (trainings.append(1), real_train(*a, **k))[1])
    _, whole = _prepare(f"text:{text}", tmp_path / "whole", train_vocab=1500)
    assert len(trainings) == 1

    out = tmp_path / "out"
    real_write = prepare_module._write_shard

    def crash_after_two(out_dir, index, *rest):
        if index == 2:
            raise KeyboardInterrupt
        return real_write(out_dir, index, *rest)

    monkeypatch.setattr(prepare_module, "_write_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        _prepare(f"text:{text}", out, train_vocab=1500)
    assert len(trainings) == 2 and (out / prepare_module.STATE_FILE).is_file()
    monkeypatch.setattr(prepare_module, "_write_shard", real_write)
    _, resumed = _prepare(f"text:{text}", out, train_vocab=1500)
    assert len(trainings) == 2 and resumed == whole  # resumed with the tokenizer it had trained
    _, again = _prepare(f"text:{text}", out, train_vocab=1500)
    assert len(trainings) == 2 and again == whole  # prepared again, the tokenizer kept

    _prepare(f"text:{text}", out, train_vocab=1200)  # other options
    assert len(trainings) == 3
    with open(text / "doc-03.txt", "a") as f:
        f.write("\nAn added paragraph changes the source.\n")
    _, edited = _prepare(f"text:{text}", out, train_vocab=1500)
    assert len(trainings) == 4 and edited != whole


# -- a tokenizer by its name --------------------------------------------------------------
def test_a_tokenizer_named_from_the_hf_cache_prepares_the_same_shards_as_its_file(trained, tmp_path,
                                                                                   hf_home, monkeypatch):
    file = trained[0] / "tokenizer.json"
    _cache_model(hf_home / "hub", "test-org/bpe-1k", file.read_bytes())
    _cache_model(hf_home / "hub", "bpe1k", file.read_bytes())
    text = _text_dir(tmp_path, docs=4)
    by_file, digest = _prepare(f"text:{text}", tmp_path / "by-file", tokenizer_path=file)
    for run, name in enumerate(("test-org/bpe-1k", f"test-org/bpe-1k@{REVISION}", "bpe1k")):
        out = tmp_path / f"by-name{run}"
        manifest, named = _prepare(f"text:{text}", out, tokenizer_path=name)
        assert named == digest, name
        assert _tokens(out, manifest).tobytes() == _tokens(tmp_path / "by-file", by_file).tobytes()
        assert (out / "tokenizer.json").read_bytes() == file.read_bytes()
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    assert _prepare(f"text:{text}", tmp_path / "by-hub-cache", tokenizer_path="test-org/bpe-1k")[1] == digest


# -- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("options, named", [
    (["--train-tokenizer", "100"], "--train-tokenizer 100: a trained vocabulary holds 257 to"),
    (["--train-tokenizer", "256"], "--train-tokenizer 256:"),
    (["--train-tokenizer", str(2**32 + 1)], f"--train-tokenizer {2**32 + 1}:"),
    (["--tokenizer", "no-org/no-model"], "--tokenizer no-org/no-model: no such file, and no tokenizer.json"),
    (["--tokenizer", "gpt2"], "no tokenizer.json of a Hugging Face model gpt2 in the cache"),
    (["--tokenizer", "gpt2", "--train-tokenizer", "8192"], "not both"),
])
def test_bad_tokenizer_options_are_one_line_and_exit_status_2(tmp_path, hf_home, capsys, options, named):
    text = _text_dir(tmp_path, docs=2)
    out = tmp_path / "out"
    assert cli_main(["data", "prepare", f"text:{text}", "--out", str(out), "--no-progress", *options]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("swarm-node data: error: "), lines
    assert named in lines[0], lines[0]
    if "gpt2" in named:
        assert str(hf_home / "hub") in lines[0]  # says where it looked
    assert not out.exists()


def test_a_token_file_is_no_text_to_train_on(tmp_path, capsys):
    ids = tmp_path / "ids.bin"
    np.arange(3000, dtype=np.uint16).repeat(4).tofile(ids)
    out = tmp_path / "out"
    assert cli_main(["data", "prepare", f"bin:{ids}", "--out", str(out), "--train-tokenizer", "8192",
                     "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--train-tokenizer: bin:" in lines[0] and "not text" in lines[0], lines
    assert not out.exists()

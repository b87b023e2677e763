"""Prepared datasets: the shard file format, the manifest (hashed, parsed as untrusted
input), `swarm-node data prepare` (resumable, tokenizer checked) and the slots that
keep stage-0 replicas on disjoint shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_node.cli.main import main as cli_main
from swarm_node.data import prepare as prepare_module
from swarm_node.data.dataset import load_windows
from swarm_node.data.manifest import MANIFEST_FILE, Manifest, local_manifest_sha256, sha256_hex
from swarm_node.data.prepare import PrepareConfig, prepare
from swarm_node.data.shard_format import HEADER_BYTES, open_shard, parse_header, shard_bytes
from swarm_node.data.slot_batches import choose_slot, slot_units
from swarm_node.data.spec import DataSpec
from swarm_node.data.tokenizer import HFTokenizer
from swarm_node.errors import ConfigError, DataError
from swarm_node.spec import RunSpec


def small_prepare(out: Path, **options) -> tuple[Manifest, str]:
    options = {"source": "corpus", "out_dir": out, "shard_tokens": 200_000, "chunk_bytes": 64 << 10,
               "progress": False, **options}
    return prepare(PrepareConfig(**options))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Manifest, str]:
    out = tmp_path_factory.mktemp("prepared")
    manifest, digest = small_prepare(out)
    return out, manifest, digest


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory) -> Path:
    """A 2,000-token BPE trained on the bundled corpus, as a host would train one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from swarm_node.data.dataset import _read_corpus

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["[UNK]"], show_progress=False)
    text = _read_corpus()
    tokenizer.train_from_iterator([text[i:i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


# -- shard files --------------------------------------------------------------------------
@given(st.lists(st.integers(0, 2**16 - 1), max_size=300), st.integers(2**16 + 1, 2**20))
@settings(max_examples=100, deadline=None)
def test_shard_files_round_trip_tokens_of_either_width(tokens, big_vocab):
    for vocab in (2**16, big_vocab):
        data = shard_bytes(np.asarray(tokens, dtype=np.int64), vocab)
        dtype, got_vocab, count = parse_header(data[:HEADER_BYTES], len(data), vocab_size=vocab)
        assert (got_vocab, count, dtype.itemsize) == (vocab, len(tokens), 2 if vocab <= 2**16 else 4)
        assert np.frombuffer(data[HEADER_BYTES:], dtype=dtype).tolist() == tokens


def test_a_truncated_or_foreign_shard_is_refused_on_open(tmp_path):
    data = shard_bytes(np.arange(1000), 4096)
    cases = {"short.tok": data[:-2], "magic.tok": b"X" + data[1:], "header.tok": data[:10],
             "dtype.tok": data[:8] + b"\x07" + data[9:]}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(DataError):
            open_shard(tmp_path / name)
    (tmp_path / "ok.tok").write_bytes(data)
    assert open_shard(tmp_path / "ok.tok", vocab_size=4096)[-1] == 999
    with pytest.raises(DataError, match="vocabulary"):
        open_shard(tmp_path / "ok.tok", vocab_size=256)


# -- the manifest -------------------------------------------------------------------------
def test_the_manifest_is_named_by_the_hash_of_its_bytes(prepared):
    out, manifest, digest = prepared
    data = (out / MANIFEST_FILE).read_bytes()
    assert sha256_hex(data) == digest == manifest.sha256() == local_manifest_sha256(out)
    assert Manifest.from_bytes(data, expect_sha256=digest) == manifest
    with pytest.raises(DataError, match="not the run spec's"):
        Manifest.from_bytes(data.replace(b'"vocab_size":256', b'"vocab_size":257'), expect_sha256=digest)
    spec = RunSpec(data=DataSpec.parse(f"manifest:{digest}"))
    assert spec.data.manifest_sha256 == digest and spec.data.path is None
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).spec_hash() == spec.spec_hash()
    other = RunSpec(data=DataSpec(kind="manifest", manifest_sha256="0" * 64))
    assert other.spec_hash() != spec.spec_hash()  # the spec's hash, and its signature, cover the data


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_any_altered_manifest_is_a_data_error_never_a_crash(prepared_bytes, data):
    raw = json.loads(prepared_bytes)
    paths = [("vocab_size",), ("dtype",), ("chunk_bytes",), ("train", 0, "name"), ("train", 0, "bytes"),
             ("train", 0, "chunks"), ("train", 0, "sha256"), ("train", 0, "tokens"), ("val",), ("sources",),
             ("tokenizer",), ("format",), ("train", 0)]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(st.one_of(st.none(), st.integers(-2**70, 2**70), st.text(max_size=80), st.booleans(),
                                st.lists(st.integers(), max_size=3), st.just("../../etc/passwd"),
                                st.just({"name": "x"})))
    target = raw
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    try:
        Manifest.from_bytes(json.dumps(raw).encode())
    except DataError:
        pass


@pytest.fixture(scope="module")
def prepared_bytes(prepared) -> bytes:
    return (prepared[0] / MANIFEST_FILE).read_bytes()


# -- prepare ------------------------------------------------------------------------------
def test_prepared_shards_hold_the_source_tokens_in_order(prepared):
    out, manifest, digest = prepared
    assert len(manifest.train) >= 5 and len(manifest.val) == 1 and manifest.tokenizer is None
    tokens = np.concatenate([open_shard(out / e.name, vocab_size=256) for e in manifest.train + manifest.val])
    from swarm_node.data.dataset import corpus_documents
    parts = corpus_documents()
    expected = b"".join((p + "\n\n").encode() for p in parts)
    assert tokens.tobytes() == np.frombuffer(expected, dtype=np.uint8).astype(np.uint16).tobytes()
    assert all(e.tokens == 200_000 for e in manifest.train)
    windows = load_windows(DataSpec.parse(f"manifest:{out}"), seq_len=64)  # a local run reads it whole
    assert windows.vocab_size == 256 and windows.num_val_windows == manifest.val[0].tokens // 65


def test_an_interrupted_prepare_resumes_at_the_document_it_stopped(tmp_path, prepared, monkeypatch):
    _, _, digest = prepared
    real = prepare_module._write_shard
    written = []

    def crash_after_three(out, index, tokens, vocab, config):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(index)
        return real(out, index, tokens, vocab, config)

    monkeypatch.setattr(prepare_module, "_write_shard", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        small_prepare(tmp_path)
    assert not (tmp_path / MANIFEST_FILE).exists()
    state = json.loads((tmp_path / prepare_module.STATE_FILE).read_text())
    assert len(state["shards"]) == 3 and state["docs_done"] > 0
    encoded = []
    monkeypatch.setattr(prepare_module, "_write_shard", lambda *a: (written.append(a[1]), real(*a))[1])
    original = prepare_module._token_stream
    monkeypatch.setattr(prepare_module, "_token_stream",
                        lambda *a, **k: (encoded.append(k["skip"]), original(*a, **k))[1])
    _, again = small_prepare(tmp_path)
    assert again == digest  # the same bytes as a preparation never interrupted
    assert encoded == [state["docs_done"]] and written[3] == 3  # no shard written twice
    assert not (tmp_path / prepare_module.STATE_FILE).exists()
    with pytest.raises(ConfigError, match="other settings"):
        (tmp_path / prepare_module.STATE_FILE).write_text(json.dumps({**state, "settings": {}}))
        small_prepare(tmp_path)


def test_a_bpe_tokenizer_sizes_the_vocabulary_and_travels_in_the_manifest(tmp_path, bpe_tokenizer):
    manifest, digest = small_prepare(tmp_path, tokenizer_path=bpe_tokenizer, shard_tokens=50_000)
    tokenizer = HFTokenizer(bpe_tokenizer)
    assert manifest.vocab_size == tokenizer.vocab_size == 2000 and manifest.dtype == "u16"
    assert manifest.tokenizer.sha256 == sha256_hex(bpe_tokenizer.read_bytes())
    assert (tmp_path / "tokenizer.json").read_bytes() == bpe_tokenizer.read_bytes()
    first = open_shard(tmp_path / manifest.train[0].name, vocab_size=2000)
    from swarm_node.data.dataset import corpus_documents
    assert first[:40].tolist() == tokenizer.encode(corpus_documents()[0] + "\n\n")[:40]
    windows = load_windows(DataSpec.parse(f"manifest:{tmp_path}"), seq_len=32)
    assert windows.tokenizer.vocab_size == 2000


def test_token_ids_outside_the_tokenizer_vocabulary_are_refused(tmp_path, bpe_tokenizer):
    ids = tmp_path / "ids.bin"
    np.arange(5000, dtype=np.uint16).repeat(4).tofile(ids)
    with pytest.raises(DataError, match="outside the tokenizer's vocabulary"):
        small_prepare(tmp_path / "out", source=f"bin:{ids}", tokenizer_path=bpe_tokenizer)
    manifest, _ = small_prepare(tmp_path / "plain", source=f"bin:{ids}", shard_tokens=4096)
    assert (
        manifest.vocab_size == 5000
        and manifest.train_tokens() + sum(e.tokens for e in manifest.val) == 20_000
    )


def test_prepare_refuses_too_little_data_and_synthetic(tmp_path):
    (tmp_path / "t.txt").write_text("tiny")
    with pytest.raises(DataError, match="too few"):
        small_prepare(tmp_path / "a", source=f"text:{tmp_path / 't.txt'}", shard_tokens=1024)
    with pytest.raises(ConfigError, match="nothing to prepare"):
        small_prepare(tmp_path / "b", source="synthetic")


def test_the_command_prints_the_spec_table(tmp_path, capsys):
    assert cli_main(["data", "prepare", "corpus", "--out", str(tmp_path), "--shard-tokens", "400000",
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    digest = local_manifest_sha256(tmp_path)
    assert f'manifest_sha256 = "{digest}"' in out and 'kind = "manifest"' in out
    assert f"swarm-bootstrap --run-spec RUN.toml --data {tmp_path}" in out


# -- slots --------------------------------------------------------------------------------
@given(st.integers(1, 12), st.integers(1, 40), st.integers(0, 3), st.integers(0, 2**31))
@settings(max_examples=200, deadline=None)
def test_slots_deal_each_pass_out_disjointly(files, num_slots, data_pass, seed):
    manifest = _manifest_of(files)
    dealt = [slot_units(manifest, seed, data_pass, k, num_slots) for k in range(num_slots)]
    flat = [u for units in dealt for u in units]
    assert len(flat) == len(set(flat))  # no unit in two slots
    assert {u.shard for u in flat} == set(range(files))  # every shard dealt each pass


@given(st.lists(st.sampled_from([f"Qm{c}" for c in "ABCDEFGHJK"]), min_size=1, max_size=10, unique=True),
       st.integers(1, 12))
@settings(max_examples=200, deadline=None)
def test_peers_that_claim_together_end_on_distinct_slots(peers, num_slots):
    """Everyone picks at once from the same (empty) view, then each looks again at the
    others' claims, one at a time, as registry refreshes come: they settle on distinct
    slots while there are enough."""
    claims = {p: choose_slot(p, {}, num_slots, None) for p in peers}
    for _ in range(len(peers)):
        for p in peers:
            claims[p] = choose_slot(p, claims, num_slots, claims[p])
    if len(peers) <= num_slots:
        assert len(set(claims.values())) == len(peers)


def _manifest_of(files: int) -> Manifest:
    from swarm_node.data.manifest import FileEntry
    entry = [FileEntry(name=f"s{i}", bytes=HEADER_BYTES + 2000, sha256="0" * 64, chunks=("0" * 64,),
                       tokens=1000)
             for i in range(files)]
    return Manifest(vocab_size=256, dtype="u16", chunk_bytes=1 << 20, tokenizer=None, train=tuple(entry),
                    val=())


def test_export_finds_the_prepared_tokenizer_in_the_folder_or_the_cache(tmp_path, bpe_tokenizer):
    from swarm_node.data.source import prepared_tokenizer

    folder = tmp_path / "host"
    _, digest = small_prepare(folder, tokenizer_path=bpe_tokenizer, shard_tokens=50_000)
    held = DataSpec(kind="manifest", manifest_sha256=digest, path=str(folder))
    assert prepared_tokenizer(held, tmp_path / "nowhere") == folder / "tokenizer.json"
    cache = tmp_path / "cache" / digest[:16]
    cache.mkdir(parents=True)
    for name in (MANIFEST_FILE, "tokenizer.json"):
        (cache / name).write_bytes((folder / name).read_bytes())
    fetched = DataSpec(kind="manifest", manifest_sha256=digest)
    assert prepared_tokenizer(fetched, tmp_path / "cache") == cache / "tokenizer.json"
    (cache / "tokenizer.json").write_text("{}")  # altered: not the run's
    with pytest.raises(DataError, match="--tokenizer"):
        prepared_tokenizer(fetched, tmp_path / "cache")


def test_one_long_document_is_written_down_in_linear_time(tmp_path, monkeypatch):
    """The tokens carried into the next shard are written down once per document, and
    fewer than a shard's: a document of 40 shards does not rewrite its rest 40 times."""
    text = tmp_path / "long.txt"
    text.write_text("".join(f"line {i} of one long document\n" for i in range(1500)))  # about 40 KB
    saved = []
    real = prepare_module._save_state
    monkeypatch.setattr(prepare_module, "_save_state", lambda out, settings, shards, done,
                        carry: (saved.append(len(carry)), real(out, settings, shards, done, carry))[1])
    manifest, _ = small_prepare(tmp_path / "out", source=f"text:{text}", shard_tokens=1024)
    assert len(manifest.train) >= 30
    assert sum(saved) < 2 * 1024 and all(carry < 1024 for carry in saved)


def test_a_text_file_is_read_in_blocks_with_the_same_tokens(tmp_path, monkeypatch):
    text = tmp_path / "big.txt"
    text.write_text("".join(f"paragraph {i}: {'é' * (i % 7)} words\n" for i in range(3000)))
    _, whole = small_prepare(tmp_path / "whole", source=f"text:{text}", shard_tokens=4096)
    lengths = []
    real = prepare_module.ByteTokenizer.encode
    monkeypatch.setattr(prepare_module.ByteTokenizer, "encode",
                        lambda self, t: (lengths.append(len(t.encode())), real(self, t))[1])
    monkeypatch.setattr(prepare_module, "TEXT_BLOCK_BYTES", 4096)
    _, blocks = small_prepare(tmp_path / "blocks", source=f"text:{text}", shard_tokens=4096)
    assert blocks == whole and len(lengths) > 10 and max(lengths) < 2 * 4096


def test_prepare_refuses_a_prepared_dataset_as_its_source(tmp_path, prepared):
    with pytest.raises(ConfigError, match="prepared dataset already"):
        small_prepare(tmp_path / "again", source=f"manifest:{prepared[0]}")


@pytest.mark.parametrize(("limit", "value"), [("MAX_SHARDS", 5), ("MAX_MANIFEST_BYTES", 12_000)])
def test_a_dataset_the_protocol_cannot_carry_is_refused_while_it_is_prepared(tmp_path, monkeypatch, limit,
                                                                             value):
    monkeypatch.setattr(prepare_module, limit, value)
    with pytest.raises(DataError, match="more than the data protocol carries"):
        small_prepare(tmp_path, shard_tokens=4096, chunk_bytes=4096)
    assert len(list(tmp_path.glob("shard-*.tok"))) <= 40  # refused early, not after all ~400 shards
    assert not (tmp_path / MANIFEST_FILE).exists()


@pytest.mark.parametrize("name", ["shard-00000.tok.part", "x.have", "tokenizer.json.tmp", "a.lock",
                                  ".hidden"])
def test_a_manifest_naming_a_file_like_a_cache_sidecar_is_refused(prepared, name):
    """A cache keeps NAME.part, NAME.have, staging and lock files beside its files: no
    file of a manifest may be named like one."""
    data = json.loads((prepared[0] / MANIFEST_FILE).read_bytes())
    data["train"][0]["name"] = name
    with pytest.raises(DataError, match="bad file name"):
        Manifest.from_bytes(json.dumps(data).encode())


def test_a_mirror_url_with_a_query_is_refused_at_prepare(tmp_path):
    with pytest.raises(ConfigError, match="--mirror"):
        small_prepare(tmp_path, sources=("https://example.org/data?token=x",))

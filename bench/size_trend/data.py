"""Subword text for the size trend, tokenized with a BPE tokenizer the benchmark trains
once and keeps (bench/results/size_trend.tokenizer.json, so every later run reads the
same tokens) and prepared into shards with `swarm-node data prepare` in a cache folder
(rebuilt when missing).

Two corpora. Quick mode: the bundled corpus (stdlib docstrings, about 390k tokens), no
download. Full mode: that corpus and the documentation sources of two pinned PyPI
sdists, Django's and SQLAlchemy's (about 3.4M tokens of English technical prose): the
full runs train 4.1M tokens, which on the bundled corpus alone is ten passes, where a
5M-parameter model can memorise what it reads (not measured here: avoided); on the
larger corpus a run is about 1.2 passes, near the paper's single pass. The sdists come through pip
(whatever index it is set to use) and are checked against their SHA-256 here before a
byte of them is read."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import ROOT
from bench.common.results import RESULTS_DIR

VOCAB = 4096
TOKENIZER = RESULTS_DIR / "size_trend.tokenizer.json"
DATA_ROOT = ROOT / "runs" / "bench-data" / "size_trend"
SHARD_TOKENS = 1 << 16
VAL_FRACTION = 0.05


@dataclass(frozen=True)
class Sdist:
    """A pinned source distribution whose documentation is text for the benchmark."""

    name: str
    version: str
    sha256: str
    docs_folder: str  # inside the archive's top folder
    suffix: str

    def find(self, folder: Path) -> Path | None:
        wanted = f"{self.name}-{self.version}.tar.gz".lower()
        return next((p for p in folder.glob("*.tar.gz") if p.name.lower() == wanted), None)


DOC_SDISTS = (
    Sdist("Django", "5.1.4", "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a", "docs",
          ".txt"),
    Sdist("sqlalchemy", "2.0.36", "7f2767680b6d2398aea7082e45a774b2b0767b5c8d8ffb9c8b683088ea9b29c5",
          "doc/build",
          ".rst"),
)


class CorpusError(RuntimeError):
    """A pinned sdist could not be fetched or is not the pinned file."""


def bundled_documents() -> list[str]:
    from swarm_node.data.dataset import corpus_documents

    return corpus_documents()


def fetch_sdist(sdist: Sdist, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = sdist.find(folder)
    if path is None:
        spec = f"{sdist.name}=={sdist.version}"
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               "-q",
                               "-d", str(folder), spec], capture_output=True, text=True)
        path = sdist.find(folder)
        if done.returncode != 0 or path is None:
            raise CorpusError(f"pip could not download {spec}: {done.stderr.strip()[-300:]}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sdist.sha256:
        path.unlink()
        raise CorpusError(f"{path.name} has SHA-256 {digest}, not the pinned {sdist.sha256}: removed")
    return path


def sdist_documents(sdist: Sdist, archive: Path) -> list[tuple[str, str]]:
    """(name inside the archive, text) of every documentation file, read from the archive
    without extracting it."""
    docs = []
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            parts = member.name.split("/", 1)
            if (member.isfile() and len(parts) == 2 and parts[1].startswith(sdist.docs_folder + "/")
                    and member.name.endswith(sdist.suffix)):
                docs.append((member.name, tar.extractfile(member).read().decode("utf-8", errors="replace")))
    if not docs:
        raise CorpusError(f"{archive.name} holds no {sdist.suffix} files under {sdist.docs_folder}/")
    return sorted(docs)


def write_docs_corpus(text_dir: Path, downloads: Path) -> Path:
    """The full corpus as one file per document in ``text_dir``, named by a hash of where
    it came from: `data prepare text:` reads files in name order, so the documents of all
    three sources are interleaved and the validation shards (the last ones) mix them."""
    named = [(f"corpus/{i}", text) for i, text in enumerate(bundled_documents())]
    for sdist in DOC_SDISTS:
        named += sdist_documents(sdist, fetch_sdist(sdist, downloads))
    # renamed whole: a folder that exists is complete
    partial = text_dir.with_name(text_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for origin, text in named:
        (partial / f"{hashlib.sha256(origin.encode()).hexdigest()[:16]}.txt").write_text(text,
                                                                                         encoding="utf-8")
    shutil.rmtree(text_dir, ignore_errors=True)
    partial.rename(text_dir)
    return text_dir


def train_tokenizer(documents: list[str], path: Path = TOKENIZER, vocab: int = VOCAB) -> Path:
    """A byte-level BPE of ``vocab`` tokens trained on ``documents``, as `swarm-node data
    prepare --train-tokenizer` trains one (the kept file predates it: it has no
    end-of-text token, so its documents end with a blank line)."""
    from swarm_node.data.bpe import train_bpe

    data = train_bpe(documents, vocab, count=len(documents))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def subword_data(corpus: str, tokenizer: Path = TOKENIZER, root: Path = DATA_ROOT) -> str:
    """The data spec (``manifest:FOLDER``) of ``corpus`` ("bundled" or "docs") in subword
    tokens, prepared on first use. The tokenizer is trained on the docs corpus when it is
    not kept yet (that downloads the sdists once)."""
    from swarm_node.data.manifest import MANIFEST_FILE, Manifest, sha256_hex
    from swarm_node.data.prepare import PrepareConfig, prepare

    if corpus not in ("bundled", "docs"):
        raise ValueError(f"unknown corpus {corpus!r}")
    text_dir = root / "docs-text"
    if not tokenizer.is_file():
        write_docs_corpus(text_dir, root / "downloads")
        train_tokenizer([p.read_text(encoding="utf-8") for p in sorted(text_dir.glob("*.txt"))], tokenizer)
    out_dir = root / corpus
    manifest_path = out_dir / MANIFEST_FILE
    if manifest_path.is_file():
        manifest = Manifest.from_bytes(manifest_path.read_bytes())
        if manifest.tokenizer is not None and manifest.tokenizer.sha256 == sha256_hex(tokenizer.read_bytes()):
            return f"manifest:{out_dir}"
    if corpus == "docs" and not text_dir.is_dir():
        write_docs_corpus(text_dir, root / "downloads")
    source = "corpus" if corpus == "bundled" else f"text:{text_dir}"
    prepare(PrepareConfig(source=source, out_dir=out_dir, tokenizer_path=tokenizer, shard_tokens=SHARD_TOKENS,
                          val_fraction=VAL_FRACTION, progress=False))
    return f"manifest:{out_dir}"


def data_identity(spec: str) -> str:
    """The manifest's SHA-256: what the ledger keys runs by, so runs on other tokens never
    count as done."""
    from swarm_node.data.manifest import MANIFEST_FILE, sha256_hex

    return sha256_hex((Path(spec.split(":", 1)[1]) / MANIFEST_FILE).read_bytes())

"""Rebuild the bundled demo corpus from the docstrings of CPython's standard library.

The corpus ships in the repository (swarm_node/data/corpus/) so every machine trains
on the same bytes; this script documents exactly where those bytes came from and lets
anyone regenerate them:

    python tools/build_corpus.py --out swarm_node/data/corpus/stdlib_docstrings.txt.gz

Source: module, class and function docstrings of the pure-Python standard library of
the running interpreter (tests, idlelib, turtledemo and site-packages excluded), in
sorted file order. Licence: Python Software Foundation License 2.0, which permits
redistribution of derived works with the licence notice (see corpus/NOTICE).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import os
import sys
import warnings
from pathlib import Path

EXCLUDED_PARTS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "lib2to3", "__pycache__"}
MIN_DOCSTRING_CHARS = 40


def iter_stdlib_files(root: Path):
    for path in sorted(root.rglob("*.py")):
        if EXCLUDED_PARTS.isdisjoint(path.relative_to(root).parts):
            yield path


def docstrings_of(path: Path):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS and doc.isascii():
                yield doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    root = Path(os.__file__).parent
    seen: set[str] = set()
    docs = []
    for path in iter_stdlib_files(root):
        for doc in docstrings_of(path):
            if doc not in seen:
                seen.add(doc)
                docs.append(doc)
    text = "\n\n".join(docs) + "\n"
    with gzip.GzipFile(args.out, "wb", mtime=0) as fh:
        fh.write(text.encode("ascii"))
    print(f"{len(docs)} docstrings, {len(text) / 1e6:.2f} MB from Python {sys.version.split()[0]} -> {args.out}")


if __name__ == "__main__":
    main()

"""Wrap the lines over pyproject's ruff line length, and only those (issue 53: a one-time fix, kept
to be rerun on a branch that adds long lines).

    python tools/wrap_long_lines.py swarm_node bootstrap bench tests

Two mechanical steps a file, and nothing else moves:
- a trailing comment that makes its line too long goes on its own lines just above it, at
  the line's indentation;
- a statement (or a compound statement's header) with a line still too long is formatted
  alone by `ruff format` (pyproject's [tool.ruff.format]), at its own indentation.
  Whole-file `ruff format` would re-lay thousands of lines that fit, and push nine files
  of swarm_node over 450 lines; `ruff format --range` drops trailing comments.
Comments are counted before and after in each file; a file whose count changes, or that
no longer compiles, is left as it was. Long strings, docstrings and comment-only lines
are left to a person.
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import textwrap
import tokenize
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"]
RUFF = str(Path(sys.executable).parent / "ruff")


def comment_words(source: str) -> list[str]:
    """Every comment's words, in order (a moved comment may be wrapped onto more lines)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [word for t in tokens if t.type == tokenize.COMMENT for word in t.string.lstrip("#").split()]


def move_trailing_comments(source: str) -> str:
    lines = source.split("\n")
    moves = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        row, col = token.start
        line = lines[row - 1]
        if token.type != tokenize.COMMENT or len(line) <= LIMIT or not line[:col].strip():
            continue
        if token.string.startswith(("# noqa", "# type:", "# pragma")) or len(line[:col].rstrip()) > LIMIT:
            continue
        moves[row] = col
    for row in sorted(moves, reverse=True):
        line, col = lines[row - 1], moves[row]
        indent = line[: len(line) - len(line.lstrip())]
        text = lines[row - 1][col:].lstrip("#").strip()
        wrapped = textwrap.wrap(text, LIMIT - len(indent) - 2, break_long_words=False, break_on_hyphens=False)
        lines[row - 1 : row] = [f"{indent}# {w}" for w in wrapped] + [line[:col].rstrip()]
    return "\n".join(lines)


def split_at_commas(source: str) -> str:
    """Break each long line after its rightmost comma that fits, inside brackets, the rest
    aligned after the opening bracket (or at the line's indentation under a bracket that
    ends its line): the layout the code already uses. Repeated while that helps."""
    for _ in range(20):
        lines = source.split("\n")
        stack: list[tuple[int, int, bool]] = []
        best: dict[int, tuple[int, int]] = {}  # row -> (split column, continuation indent)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        for i, token in enumerate(tokens):
            row, col = token.start
            if token.type == tokenize.OP and token.string in "([{":
                ends_line = tokens[i + 1].type in (tokenize.NL, tokenize.COMMENT)
                stack.append((row, col, ends_line))
            elif token.type == tokenize.OP and token.string in ")]}":
                stack.pop()
            elif token.type == tokenize.OP and token.string == "," and stack and len(lines[row - 1]) > LIMIT:
                open_row, open_col, ends_line = stack[-1]
                line = lines[row - 1]
                indent = len(line) - len(line.lstrip())
                cont = indent if ends_line or open_row != row and open_col + 1 > indent + 40 else open_col + 1
                if ends_line and open_row == row:
                    continue  # a hanging bracket on this line: leave it to ruff format
                rest = line[token.end[1] :].lstrip()
                if token.end[1] <= LIMIT and token.end[1] > cont and rest and not rest.startswith("#"):
                    best[row] = (token.end[1], cont)
        if not best:
            return source
        for row in sorted(best, reverse=True):
            line = lines[row - 1]
            at, cont = best[row]
            lines[row - 1 : row] = [line[:at].rstrip(), " " * cont + line[at:].lstrip()]
        source = "\n".join(lines)
    return source


def header_end(lines: list[str], first: int) -> int | None:
    """The line (1-based) of the colon that ends a compound statement's header from ``first``."""
    text = "\n".join(lines[first - 1 :]) + "\n"
    depth = 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.OP and token.string in "([{":
                depth += 1
            elif token.type == tokenize.OP and token.string in ")]}":
                depth -= 1
            elif token.type == tokenize.OP and token.string == ":" and depth == 0:
                return first + token.start[0] - 1
    except tokenize.TokenError:
        return None
    return None


def spans(source: str) -> list[tuple[int, int, bool]]:
    """(first line, last line, is a header) of every statement and compound header."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.stmt):
            continue
        body = getattr(node, "body", None)
        if isinstance(body, list) and body:
            end = header_end(source.split("\n"), node.lineno)
            if end is not None and end < body[0].lineno:
                found.append((node.lineno, end, True))
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            line = source.split("\n")[node.lineno - 1]
            if not line[: node.col_offset].strip():
                found.append((node.lineno, node.end_lineno, False))
    return found


def ruff_format(snippet: str, width: int) -> str | None:
    done = subprocess.run([RUFF, "format", "--quiet", "--line-length", str(width), "--stdin-filename", "snippet.py",
                           "-"], input=snippet, capture_output=True, text=True, cwd=ROOT)
    return done.stdout if done.returncode == 0 else None


def wrap_statements(source: str) -> str:
    lines = source.split("\n")
    long_rows = {i + 1 for i, line in enumerate(lines) if len(line) > LIMIT}
    chosen: list[tuple[int, int, bool]] = []
    for first, last, header in spans(source):
        if not any(first <= row <= last for row in long_rows):
            continue
        # the innermost: drop spans that hold this one
        chosen = [c for c in chosen if not (c[0] <= first and last <= c[1])]
        if not any(first <= c[0] and c[1] <= last for c in chosen):
            chosen.append((first, last, header))
    for first, last, header in sorted(chosen, reverse=True):
        block = lines[first - 1 : last]
        indent = block[0][: len(block[0]) - len(block[0].lstrip())]
        if any(line.strip() and not line.startswith(indent) for line in block[1:]):
            continue  # a string or continuation that starts at column 0
        snippet = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in block)
        elif_ = snippet.startswith("elif ")
        if header:
            snippet = ("if " + snippet[5:] if elif_ else snippet) + "\n    pass"
        formatted = ruff_format(snippet + "\n", LIMIT - len(indent))
        if formatted is None:
            continue
        new = formatted.rstrip("\n").split("\n")
        if header:
            if new[-1].strip() != "pass":
                continue
            new = new[:-1]
            if elif_:
                new[0] = "elif " + new[0][3:]
        lines[first - 1 : last] = [indent + line if line else line for line in new]
    return "\n".join(lines)


def fix(path: Path) -> bool:
    source = path.read_text()
    if not any(len(line) > LIMIT for line in source.split("\n")):
        return False
    new = wrap_statements(split_at_commas(move_trailing_comments(source)))
    try:
        compile(new, str(path), "exec")
    except SyntaxError as e:
        print(f"{path}: left as it was ({e})", file=sys.stderr)
        return False
    if comment_words(new) != comment_words(source):
        print(f"{path}: left as it was (its comments would change)", file=sys.stderr)
        return False
    if new != source:
        path.write_text(new)
        return True
    return False


def main(folders: list[str]) -> None:
    changed = 0
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            changed += fix(path)
    print(f"{changed} files changed")


if __name__ == "__main__":
    main(sys.argv[1:])

"""What the docs tell people to type is real. Every command line in a fenced block of the
README and of docs/*.md (and the systemd unit's ExecStart) parses with the current
command-line parsers, its multiaddrs and listen addresses pass the checks the programs
make before they start, and the repository files it names exist; every flag named in an
inline command, in a flag table or anywhere else in code exists; every link points at a
file and heading that exist; and the tables made by code are what the code prints.
Nothing is run: each parser is built and given the arguments."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from swarm_bootstrap.cli import _addresses
from swarm_bootstrap.cli import build_parser as bootstrap_parser

from swarm_node.cli.join import _listen_addresses
from swarm_node.cli.main import build_parser as node_parser
from swarm_node.net.maddr import check_maddrs, is_peer_id

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
GUIDES = [REPO / "docs" / name for name in ("VOLUNTEERS.md", "HOSTS.md", "DATA.md", "RESEARCHERS.md",
                                            "FAILURES.md")]
SERVICE = REPO / "examples" / "swarm-bootstrap.service"
FENCE = re.compile(r"^[ \t]*```([\w-]*)[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console", "ini")  # unlabelled blocks hold printed commands too
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
REPO_PATH = re.compile(r"^(?:tests|bench|examples|tools|swarm_node|bootstrap|docs)/[\w./*-]*$")


def _b58(raw: bytes) -> str:
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    number, text = int.from_bytes(raw, "big"), ""
    while number:
        number, digit = divmod(number, 58)
        text = alphabet[digit] + text
    return text


PEER_ID = _b58(bytes([0x12, 0x20]) + hashlib.sha256(b"a peer id for the docs").digest())  # Qm...
# The docs' placeholders (the programs refuse them as such), and what stands in for them here.
PLACEHOLDERS = ((re.compile(r"\bQm\w*\.\.\."), PEER_ID), (re.compile(r"/ip4/\.\.\./"), "/ip4/198.51.100.1/"),
                (re.compile(r"/tcp/\.\.\./"), "/tcp/31337/"))


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    argv: tuple[str, ...]  # the program first (its path dropped), then its arguments


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _without_env(words: list[str]) -> list[str]:
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    return words


def _program(word: str) -> str:
    name = word.rsplit("/", 1)[-1]
    return "./dev.sh" if name == "dev.sh" else name


def _block_commands(path: Path, text: str, start: int, body: str) -> list[Command]:
    found = []
    lines = body.split("\n")
    i = 0
    while i < len(lines):
        first, line = i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):  # shell line continuations
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        line = line.strip().removeprefix("ExecStart=")
        head = _without_env(line.split())
        if not head or _program(head[0]) not in ("swarm-node", "swarm-bootstrap", "./dev.sh", "python",
                                                 "python3", "pytest", "make"):
            continue
        for pattern, value in PLACEHOLDERS:
            line = pattern.sub(value, line)
        words = _without_env(shlex.split(line, comments=True))
        words[0] = _program(words[0])
        found.append(Command(f"{path.relative_to(REPO)}:{_line_of(text, start) + first + 1}", tuple(words)))
    return found


def block_commands(paths=DOCS) -> list[Command]:
    found = []
    for path in paths:
        text = path.read_text()
        for block in FENCE.finditer(text):
            if block.group(1) in SHELL_BLOCKS:
                found += _block_commands(path, text, block.start(2), block.group(2))
    found += _block_commands(SERVICE, SERVICE.read_text(), 0, SERVICE.read_text())
    return found


def prose(text: str) -> str:
    """The text outside fenced blocks, each block's lines kept as empty lines."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def code_spans(path: Path) -> list[tuple[str, str]]:
    """(file:line, text) of every inline code span outside fenced blocks."""
    text = prose(path.read_text())
    return [(f"{path.relative_to(REPO)}:{_line_of(text, m.start())}", " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)*)`", text)]


# --- the parsers ----------------------------------------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _all_options(parser: argparse.ArgumentParser) -> set[str]:
    found = _options(parser)
    for sub in _subparsers(parser).values():
        found |= _all_options(sub)
    return found


def _subcommand(parser: argparse.ArgumentParser,
                words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The innermost subcommand's parser that ``words`` name, and the words after it."""
    while words and words[0] in _subparsers(parser):
        parser, words = _subparsers(parser)[words[0]], words[1:]
    return parser, words


def _dev_sh() -> tuple[set[str], list[str]]:
    """dev.sh's subcommands, and the arguments `demo` gives `swarm-node` before the user's."""
    text = (REPO / "dev.sh").read_text()
    case = text[text.index('case "$cmd" in'):]
    subcommands = set(re.findall(r"^    ([\w-]+)\)$", case, re.M))
    demo = re.search(r'exec "\$VENV/bin/swarm-node" (.*?) "\$@"', re.sub(r"\\\n\s*", " ", case), re.S)
    return subcommands, shlex.split(demo.group(1))


def _markers() -> set[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return {line.split(":")[0].strip() for line in config["markers"]}


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))


def _static_flags(folder: str) -> set[str]:
    """Flags that code under ``folder`` defines (the benchmarks' and tools' own command lines)."""
    return {flag for path in (REPO / folder).rglob("*.py")
            for flag in re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]*)\"", path.read_text())}


# Flags of other programs the docs show (pip, docker, tensorboard, pytest's own).
OTHER_PROGRAMS_FLAGS = {"--index-url", "--extra-index-url", "--build-arg", "--gpus", "--build", "--logdir",
                        "--dist", "--no-loadscope-reorder"}


def known_flags() -> set[str]:
    memory = importlib.import_module("swarm_node.model.memory").build_parser()
    return (_all_options(node_parser()) | _options(bootstrap_parser()) | _options(memory)
            | _static_flags("bench") | _static_flags("tools") | OTHER_PROGRAMS_FLAGS)


def _check_paths(words) -> None:
    for word in words:
        for part in word.split("="):
            part = part.split("::")[0].rstrip(".,;:)")
            if REPO_PATH.match(part):
                found = list(REPO.glob(part)) if "*" in part else (REPO / part).exists()
                assert found, f"{part} does not exist"


def _check_pytest(args: list[str]) -> None:
    markers = _markers()
    words = iter(args)
    for word in words:
        if word == "-m":
            expression = next(words)
            unknown = set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not"} - markers
            assert not unknown, f"-m {expression!r}: no marker {sorted(unknown)} in pyproject.toml"
        elif not word.startswith("-"):
            path = word.split("::")[0]
            assert (REPO / path).exists(), f"{path} does not exist"


def _check_exact_flags(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """argparse takes a flag's prefix for the flag (`--replica` for `--replicas`); the docs
    must name it whole."""
    unknown = _flags_in(args) - _options(parser)
    assert not unknown, f"{parser.prog} has no {sorted(unknown)}"


def check_command(argv: tuple[str, ...]) -> None:
    """Parse ``argv`` with the parser of its program, then make the checks the program
    makes of its command line before it starts anything."""
    program, args = argv[0], list(argv[1:])
    _check_paths(args)
    if program == "swarm-node":
        if args == ["--version"]:
            with pytest.raises(SystemExit) as done:
                node_parser().parse_args(args)
            assert done.value.code == 0
            return
        if "--help" in args or "-h" in args:
            _, rest = _subcommand(node_parser(), args)
            assert rest in (["--help"], ["-h"]), f"no such subcommand: {args}"
            return
        parsed = node_parser().parse_args(args)
        _check_exact_flags(_subcommand(node_parser(), args)[0], args)
        if parsed.command == "join":
            check_maddrs(parsed.initial_peers, "--initial-peers", peer_id=True)
            _listen_addresses(parsed)
        if parsed.command == "probe" and parsed.maddr:
            check_maddrs([parsed.maddr], "MADDR", peer_id=True)
    elif program == "swarm-bootstrap":
        parsed = bootstrap_parser().parse_args(args)
        _check_exact_flags(bootstrap_parser(), args)
        check_maddrs(parsed.initial_peers, "--initial-peers", peer_id=True)
        _addresses(parsed)
    elif program == "./dev.sh":
        subcommands, demo = _dev_sh()
        assert args and args[0] in subcommands, f"dev.sh has no subcommand {args[:1]}: {sorted(subcommands)}"
        if args[0] == "demo":
            check_command(("swarm-node", *demo, *args[1:]))
        elif args[0].startswith("test"):
            _check_pytest(args[1:])
        elif args[0] == "bench":
            unknown = {a for a in args[1:] if a.startswith("--")} - _static_flags("bench")
            assert not unknown, f"bench.run_all has no {sorted(unknown)}"
        else:
            assert args[1:] == [], f"dev.sh {args[0]} takes no arguments"
    elif program in ("python", "python3"):
        if args[:2] == ["-m", "pytest"]:
            _check_pytest(args[2:])
        elif args[:1] == ["-m"] and args[1].startswith("swarm_node"):
            module = importlib.import_module(args[1])
            if hasattr(module, "build_parser"):
                module.build_parser().parse_args(args[2:])
                _check_exact_flags(module.build_parser(), args[2:])
            else:
                assert args[2:] == [], f"{args[1]} takes no arguments"
                source = Path(module.__file__).read_text()
                assert 'if __name__ == "__main__":' in source, f"{args[1]} is no program"
    elif program == "pytest":
        _check_pytest(args)
    elif program == "make":
        missing = set(args) - _make_targets()
        assert not missing, f"the Makefile has no target {sorted(missing)}"


@pytest.fixture(autouse=True)
def _argparse_errors_raise(monkeypatch):
    """argparse exits on a bad command line; here it raises, with its message."""
    def error(self, message):
        raise AssertionError(f"{self.prog}: {message}")

    monkeypatch.setattr(argparse.ArgumentParser, "error", error)


COMMANDS = block_commands()


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_command_in_the_docs_parses(command):
    check_command(command.argv)


def test_the_extraction_finds_the_commands_people_copy():
    """A guard for the extraction itself: a parser that found nothing would check nothing."""
    seen = {" ".join(c.argv[:3 if c.argv[1:2] == ("data",) else 2]) for c in COMMANDS}
    for command in ("swarm-node join", "swarm-node local", "swarm-node sim", "swarm-node export",
                    "swarm-node generate", "swarm-node probe", "swarm-node data prepare",
                    "swarm-bootstrap --identity",
                    "./dev.sh demo", "./dev.sh test", "./dev.sh test-slow", "./dev.sh test-gpu"):
        assert command in seen, command
    readme = {c.argv for c in COMMANDS if c.where.startswith("README.md:")}
    assert ("./dev.sh", "demo") in readme and ("./dev.sh", "test") in readme  # the quick start's two
    assert {c.where.split(":")[0] for c in COMMANDS} >= {"README.md", "docs/VOLUNTEERS.md", "docs/HOSTS.md",
                                                          "docs/RESEARCHERS.md"}


def inline_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for where, span in code_spans(path):
            words = _without_env(span.split())
            programs = ("swarm-node", "swarm-bootstrap", "./dev.sh", "python", "pytest", "make")
            if len(words) > 1 and _program(words[0]) in programs:
                found.append((where, [_program(words[0]), *words[1:]]))
    return found


def _flags_in(words) -> set[str]:
    return {m.group(0) for word in words for m in [FLAG.match(word)] if m}


def test_every_inline_command_names_flags_its_program_has():
    """`swarm-node local --chaos-kills N` in prose: the subcommand and its flags exist (the
    values are placeholders, so nothing else is parsed)."""
    checked = 0
    _, demo = _dev_sh()
    for where, words in inline_commands():
        program, args = words[0], words[1:]
        if program == "./dev.sh" and args[:1] == ["demo"]:
            program, args = "swarm-node", [*demo, *args[1:]]
        if program == "swarm-node":
            parser, rest = _subcommand(node_parser(), args)
            assert parser.prog != "swarm-node" or rest[:1] == ["--version"], \
                f"{where}: no subcommand in {words}"
        elif program == "swarm-bootstrap":
            parser, rest = bootstrap_parser(), args
        elif program == "python" and args[:2] == ["-m", "swarm_node.model.memory"]:
            parser, rest = importlib.import_module(args[1]).build_parser(), args[2:]
        elif program == "python" and args[:1] == ["-m"] and args[1].startswith("bench."):
            module = REPO / args[1].replace(".", "/")
            found = module.with_suffix(".py").exists() or (module / "__main__.py").exists()
            assert found, f"{where}: no {args[1]}"
            unknown = _flags_in(args[2:]) - _static_flags("bench")
            assert not unknown, f"{where}: `{' '.join(words)}`: the benchmarks have no {sorted(unknown)}"
            continue
        elif program in ("./dev.sh", "make", "pytest"):
            if "..." not in args:
                check_command((program, *args))
            continue
        else:
            continue
        unknown = _flags_in(rest) - _options(parser)
        assert not unknown, f"{where}: `{' '.join(words)}`: {parser.prog} has no {sorted(unknown)}"
        checked += 1
    assert checked >= 10


# Sections whose tables name one subcommand's flags.
FLAG_SECTIONS = {("docs/VOLUNTEERS.md", "Join"): "join",
                 ("docs/RESEARCHERS.md", "A local swarm: `swarm-node local`"): "local",
                 ("docs/RESEARCHERS.md", "The simulator: `swarm-node sim`"): "sim"}


def _section(path: Path, heading: str) -> str:
    text = prose(path.read_text())
    match = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert match, f"{path.name} has no heading {heading!r}"
    end = re.search(rf"^#{{1,{len(match.group(1))}}} ", text[match.end():], re.M)
    return text[match.end():match.end() + end.start() if end else len(text)]


@pytest.mark.parametrize(("doc", "heading"), sorted(FLAG_SECTIONS))
def test_every_flag_of_a_flag_table_is_its_subcommands(doc, heading):
    parser = _subparsers(node_parser())[FLAG_SECTIONS[doc, heading]]
    rows = [line for line in _section(REPO / doc, heading).splitlines() if line.startswith("|")]
    spans = [re.findall(r"`([^`]+)`", row)[0] for row in rows if row.startswith("| `")]  # the first column
    flags = _flags_in(w for span in spans if span.startswith("--") for w in span.split())
    assert len(flags) >= 8, flags
    unknown = flags - _options(parser)
    assert not unknown, f"{doc} '{heading}': {parser.prog} has no {sorted(unknown)}"


def test_every_flag_named_anywhere_in_the_docs_exists():
    known = known_flags()
    for path in DOCS:
        text = path.read_text()
        code = [m.group(2) for m in FENCE.finditer(text)] + [span for _, span in code_spans(path)]
        unknown = {flag for piece in code for flag in FLAG.findall(piece)} - known
        assert not unknown, f"{path.name} names flags no program has: {sorted(unknown)}"


def test_every_repository_path_the_docs_name_exists():
    for path in DOCS:
        for where, span in code_spans(path):
            try:
                _check_paths(span.split())
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from None


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower case, punctuation dropped."""
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text()
    return ({_slug(h) for h in re.findall(r"^#+ (.*)$", prose(text), re.M)}
            | set(re.findall(r"<a id=\"([^\"]+)\"", text)))


def test_every_link_points_at_a_file_and_heading_that_exist():
    for path in [*DOCS, REPO / "BENCHMARKS.md"]:
        text = re.sub(r"`[^`\n]*`", "", prose(path.read_text()))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            assert linked.exists(), f"{path.name}: link to {target}: no such file"
            if anchor and linked.suffix == ".md":
                assert anchor in _anchors(linked), f"{path.name}: link to {target}: no such heading"


def test_the_readme_is_a_front_door_and_each_guide_one_sitting():
    assert len(README.read_text().splitlines()) < 300
    for guide in GUIDES:
        assert len(guide.read_text().splitlines()) <= 400, f"{guide.name}: split it"


def test_the_torch_the_docs_install_is_the_one_the_tests_run_with():
    tested = re.search(r'TORCH_VERSION="\$\{SWARM_TORCH_VERSION:-([\d.]+)\}"', (REPO / "dev.sh").read_text())
    for path in DOCS:
        for version in re.findall(r"torch==([\d.]+)", path.read_text()):
            assert version == tested.group(1), \
                f"{path.name}: torch=={version}, the tests run {tested.group(1)}"


def test_the_hosts_guide_shows_the_systemd_unit_as_it_is():
    guide = (REPO / "docs" / "HOSTS.md").read_text()
    blocks = [m.group(2) for m in FENCE.finditer(guide) if m.group(1) == "ini"]
    unit = [line for line in SERVICE.read_text().splitlines() if not line.startswith("#")]
    assert blocks and blocks[0].splitlines() == unit


def test_the_placeholder_peer_id_is_one():
    assert is_peer_id(PEER_ID) and PEER_ID.startswith("Qm")

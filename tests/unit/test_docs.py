"""Commands shown to hosts and volunteers are real: they parse with the current CLI."""

import re
import shlex
from pathlib import Path

from swarm_bootstrap.cli import build_parser as bootstrap_parser

from swarm_node.cli.main import build_parser as node_parser

REPO = Path(__file__).resolve().parents[2]


def _commands(text: str, program: str) -> list[list[str]]:
    joined = re.sub(r"\\\n\s*", " ", text)  # shell line continuations
    found = []
    for line in joined.splitlines():
        line = line.strip().removeprefix("ExecStart=").split("  #")[0].strip()
        if re.match(rf"^(\S*/)?{program} ", line) and "..." not in line and "<" not in line:
            found.append(shlex.split(line)[1:])
    return found


def test_bootstrap_commands_in_the_readme_and_the_systemd_unit_parse():
    sources = [(REPO / "README.md").read_text(), (REPO / "examples" / "swarm-bootstrap.service").read_text()]
    commands = [c for text in sources for c in _commands(text, "swarm-bootstrap")]
    assert len(commands) >= 3
    for argv in commands:
        args = bootstrap_parser().parse_args(argv)
        assert args.identity is not None


def test_join_commands_in_the_readme_parse():
    commands = [c for c in _commands((REPO / "README.md").read_text(), "swarm-node") if c[:1] == ["join"]]
    assert commands
    for argv in commands:
        node_parser().parse_args(argv)


def test_data_commands_in_the_readme_parse():
    commands = [c for c in _commands((REPO / "README.md").read_text(), "swarm-node") if c[:1] == ["data"]]
    assert commands
    for argv in commands:
        node_parser().parse_args(argv)

"""A volunteer with an EMULATED GPU: ``swarm-node`` with the card of a JSON file
(bench/gpu_volunteer/emulation.py says what is emulated and what is the node's own).

    python -m bench.gpu_volunteer.card --card CARD.json join --initial-peers ... [swarm-node options]

bench.gpu_volunteer starts its volunteers so, on the test bed's hosts, each typing the
bootstrap's join line after this prefix."""

from __future__ import annotations

import sys
from pathlib import Path

from bench.gpu_volunteer.emulation import EmulatedCard, installed

USAGE = "python -m bench.gpu_volunteer.card --card CARD.json join --initial-peers ... [swarm-node options]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "--card":
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    card = EmulatedCard.read(Path(argv[1]))
    from swarm_node.cli import main as cli

    with installed(card):
        return cli.main(argv[2:])


if __name__ == "__main__":
    sys.exit(main())

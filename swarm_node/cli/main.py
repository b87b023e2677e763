"""The ``swarm-node`` command line. It only parses arguments and hands them on: each
subcommand's flags and handler live in a file of its name (sim, join, local, export,
probe, data), the flags they share in options.py and peer_options.py."""

from __future__ import annotations

import argparse
import sys

from swarm_node.cli import peer_options
from swarm_node.cli.data import add_data_parser
from swarm_node.cli.export import add_export_parser, add_generate_parser
from swarm_node.cli.join import add_join_parser
from swarm_node.cli.local import add_local_parser
from swarm_node.cli.probe import add_probe_parser
from swarm_node.cli.sim import add_sim_parser
from swarm_node.errors import SwarmError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-node",
                                     description="Peer-to-peer swarm training with NoLoCo.")
    peer_options.version(parser, program="swarm-node")
    peer_options.verbose(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_sim_parser(sub)
    add_join_parser(sub)
    add_local_parser(sub)
    add_export_parser(sub)
    add_generate_parser(sub)
    add_probe_parser(sub)
    add_data_parser(sub)
    return parser


def main(argv: list[str] | None = None, on_node=None) -> int:
    """``on_node``: called with the Node that ``join`` built, before it starts (instruments use it)."""
    from swarm_node.obs.logs import setup_logging

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.on_node = on_node
    setup_logging(args.verbose)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, ImportError, SwarmError) as exc:
        print(f"swarm-node {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"swarm-node {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

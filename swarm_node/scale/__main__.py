"""``python -m swarm_node.scale --peers 256``: one swarm-scale run, its figures as JSON."""

from __future__ import annotations

import argparse
import json
import logging
import time

from swarm_node.scale.config import ScaleConfig
from swarm_node.scale.vclock import run
from swarm_node.scale.world import World


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m swarm_node.scale", description=__doc__)
    parser.add_argument("--peers", type=int, default=16, help="peers per stage")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--method", choices=("noloco", "diloco"), default="noloco")
    parser.add_argument("--inner-steps", type=int, default=50, help="H")
    parser.add_argument("--duration-s", type=float, default=600.0, help="virtual seconds to simulate")
    parser.add_argument("--crash-per-hour", type=float, default=0.0, help="crashes per peer and hour")
    parser.add_argument("--leave-per-hour", type=float, default=0.0, help="graceful leaves per peer and hour")
    parser.add_argument("--unreachable-share", type=float, default=0.0, help="share of peers behind a NAT")
    parser.add_argument("--registry-shards", type=int, default=1, help="the run spec's registry_shards")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="the nodes' own log lines")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    config = ScaleConfig(peers_per_stage=args.peers, stages=args.stages, method=args.method,
                         inner_steps=args.inner_steps, duration_s=args.duration_s,
                         crash_per_hour=args.crash_per_hour,
                         leave_per_hour=args.leave_per_hour, unreachable_share=args.unreachable_share,
                         seed=args.seed,
                         registry_shards=args.registry_shards)
    started = time.perf_counter()
    figures = run(World(config).run())
    print(json.dumps(figures.as_dict() | {"real_s": round(time.perf_counter() - started, 1)}, indent=1))


if __name__ == "__main__":
    main()

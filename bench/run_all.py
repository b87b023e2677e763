"""Run every benchmark (quick by default, --full for the long versions) one after
another, each in its own process, then render BENCHMARKS.md from the results.

    .venv/bin/python -m bench.run_all [--full] [--only NAME ...] [--report-only]

Benchmarks that feed others run first: sync_cost and swarm_efficiency measure the
message and step times the latency model projects with, and home_link the link the
convergence benchmark's time-to-target table prices steps on."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench import report

ORDER = ("transport", "sync_cost", "swarm_efficiency", "latency_model", "home_link", "convergence",
         "size_trend", "vs_hivemind", "wire_bytes", "gpu_volunteer",
         "scale", "state_check")
QUICK_BUDGET_S = 40 * 60  # 12-19 of them the home-link benchmark's shaped links, 12 the GPU volunteers'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the long versions")
    parser.add_argument("--only", nargs="+", choices=ORDER, default=None, metavar="NAME")
    parser.add_argument("--report-only", action="store_true", help="only re-render BENCHMARKS.md")
    args = parser.parse_args(argv)
    failed = []
    if not args.report_only:
        started = time.monotonic()
        for name in args.only or ORDER:
            print(f"== bench.{name} ({'full' if args.full else 'quick'})", file=sys.stderr, flush=True)
            began = time.monotonic()
            cmd = [sys.executable, "-m", f"bench.{name}", *(["--full"] if args.full else [])]
            if subprocess.run(cmd).returncode != 0:
                failed.append(name)
            print(f"== bench.{name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
        total = time.monotonic() - started
        print(f"== all benchmarks: {total / 60:.1f} min", file=sys.stderr)
        if not args.full and args.only is None and total > QUICK_BUDGET_S:
            print(f"warning: the quick benchmarks took {total / 60:.1f} min, over their "
                  f"{QUICK_BUDGET_S // 60}-minute budget", file=sys.stderr)
    path = report.write()
    print(f"wrote {path}", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

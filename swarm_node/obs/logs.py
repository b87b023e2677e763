"""Process-wide logging set-up: one short line per event."""

from __future__ import annotations

import logging
import os


def setup_logging(verbose: bool = False) -> None:
    level = logging.DEBUG if verbose else getattr(logging, os.environ.get("SWARM_LOG_LEVEL", "INFO").upper(),
                                                   logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("matplotlib", "PIL", "hivemind"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))

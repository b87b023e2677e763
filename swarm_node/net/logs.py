"""hivemind's log records in the project's one format. hivemind installs a handler of its
own (ANSI colours, another time format) on its loggers and stops them from reaching the
root logger; undo that. Their records are kept at warnings and above, as
obs.logs.setup_logging asks (importing hivemind resets its level to its own default)."""

from __future__ import annotations

import logging

from hivemind.utils.logging import use_hivemind_log_handler


def route_hivemind_logs() -> None:
    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(max(logging.getLogger().getEffectiveLevel(), logging.WARNING))

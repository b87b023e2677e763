"""hivemind's log records in the project's one format. hivemind installs a handler of its
own (ANSI colours, another time format) on its loggers and stops them from reaching the
root logger; undo that. Their records are kept at warnings and above, as
obs.logs.setup_logging asks (importing hivemind resets its level to its own default)."""

from __future__ import annotations

import asyncio
import logging

from hivemind.utils.logging import use_hivemind_log_handler

log = logging.getLogger(__name__)


def route_hivemind_logs() -> None:
    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(max(logging.getLogger().getEffectiveLevel(), logging.WARNING))


def quiet_streams_reset_before_their_header(loop: asyncio.AbstractEventLoop) -> None:
    """hivemind's daemon bindings take each incoming stream on a connection p2pd opens to
    our unix socket. When the remote resets the stream before p2pd wrote its header (a
    dial-back probe, a caller that gave up), the bindings' callback raises
    IncompleteReadError and asyncio prints a traceback, "Unhandled exception in
    client_connected_cb", which volunteers took for a crash: nothing was lost, so it
    becomes a debug line. Every other unhandled exception goes where it went before."""
    if getattr(loop.get_exception_handler(), "quiets_resets", False):
        return
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if (isinstance(context.get("exception"), asyncio.IncompleteReadError)
                and "client_connected_cb" in context.get("message", "")):
            log.debug("an incoming stream was reset before it began: %s", context["exception"])
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.quiets_resets = True
    loop.set_exception_handler(handler)

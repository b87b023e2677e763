"""One log format: hivemind's records (warnings and above) come out like ours, without
hivemind's colours and time format, whichever is imported first."""

import logging
import re
import subprocess
import sys

SCRIPT = """
import logging
from swarm_node.obs.logs import setup_logging
setup_logging()
from swarm_node.net import dht  # imports hivemind, which installs its own handler
from hivemind.utils.logging import get_logger
get_logger("hivemind.p2p.test").warning("a hivemind warning")
get_logger("hivemind.p2p.test").info("a hivemind info")
logging.getLogger("swarm_node.test").info("ours")
"""


def test_hivemind_records_use_the_project_format():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120).stderr
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert "\x1b[" not in out, out  # no ANSI colours
    assert len(lines) == 2, out  # hivemind's info is below the level asked for
    for line, name, message in zip(lines, ("hivemind.p2p.test", "swarm_node.test"), ("a hivemind warning",
                                                                                     "ours")):
        assert re.fullmatch(rf"\d\d:\d\d:\d\d [WI] {re.escape(name)}: {message}", line), line


def test_a_stream_reset_before_its_header_is_a_debug_line_and_other_loop_errors_still_show(caplog):
    """hivemind's bindings raise IncompleteReadError in their client_connected_cb when a
    caller resets a stream early; asyncio printed that as an error with a traceback."""
    import asyncio

    from swarm_node.net.logs import quiet_streams_reset_before_their_header

    loop = asyncio.new_event_loop()
    try:
        quiet_streams_reset_before_their_header(loop)
        quiet_streams_reset_before_their_header(loop)  # a second P2P client: one handler, not two
        with caplog.at_level(logging.DEBUG):
            loop.call_exception_handler({"message": "Unhandled exception in client_connected_cb",
                                         "exception": asyncio.IncompleteReadError(b"", 1)})
            loop.call_exception_handler({"message": "Task exception was never retrieved",
                                         "exception": RuntimeError("a real bug")})
    finally:
        loop.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "a real bug" in str(errors[0].exc_info[1])
    assert any(
        "reset before it began" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records
    )

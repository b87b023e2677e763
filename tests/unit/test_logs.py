"""One log format: hivemind's records (warnings and above) come out like ours, without
hivemind's colours and time format, whichever is imported first."""

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
    for line, name, message in zip(lines, ("hivemind.p2p.test", "swarm_node.test"), ("a hivemind warning", "ours")):
        assert re.fullmatch(rf"\d\d:\d\d:\d\d [WI] {re.escape(name)}: {message}", line), line

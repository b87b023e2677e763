"""The reaper reads the node's process tree when the node says it changed (and every
few seconds besides), not twice a second: reading it means reading every process of
the machine, and 32 nodes' reapers took a core of a 2-core machine."""

import os
import queue
import signal
import subprocess
import sys
import threading

from swarm_node.net import reaper

NODE = """
import subprocess, sys, time
sys.stdin.readline()  # told when to start its child, as a node starts its DHT
child = subprocess.Popen(["sleep", "600"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _watching(requests, rescan_s):
    node = subprocess.Popen([sys.executable, "-c", NODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    scans = queue.Queue()
    stopped = []
    thread = threading.Thread(target=lambda: stopped.extend(reaper.watch(
        node.pid, poll_s=0.05, grace_s=2.0, rescan_s=rescan_s, requests=requests, after_scan=scans.put)))
    thread.start()
    assert scans.get(timeout=30) == []  # the first reading: no child yet
    node.stdin.write("go\n")
    node.stdin.flush()
    child = int(node.stdout.readline())
    return node, child, scans, thread, stopped


def test_a_child_the_node_announces_is_stopped_with_the_node():
    read_end, write_end = os.pipe()
    try:
        node, child, scans, thread, stopped = _watching(read_end, rescan_s=3600.0)
        os.write(write_end, b"\n")  # the node's "my tree changed"
        assert [pid for pid, _ in scans.get(timeout=30)] == [child]
        node.kill()
        node.wait()
        thread.join(timeout=30)
        assert [pid for pid, _ in stopped] == [child]
        assert not _alive(child)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_without_a_request_the_tree_is_read_only_every_rescan_period():
    node, child, scans, thread, stopped = _watching(None, rescan_s=3600.0)
    try:
        node.kill()
        node.wait()
        thread.join(timeout=30)
        assert stopped == [] and scans.empty()  # one reading in an hour: the child was never seen
        assert _alive(child)
    finally:
        os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

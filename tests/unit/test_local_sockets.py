"""After a local swarm, daemon sockets left by nodes killed hard are removed; sockets
something still listens on (another swarm, a benchmark's peers in other network
namespaces) are kept."""

import socket

from swarm_node.local import swarm as local
from swarm_node.net import reaper


def test_only_sockets_nobody_listens_on_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(reaper, "SOCKET_DIR", tmp_path)
    older = tmp_path / "hivemind-older.sock"
    older.touch()  # from before the run: never ours to remove
    before = local.daemon_sockets()
    live_path, stale_path = tmp_path / "hivemind-live.sock", tmp_path / "hivemind-stale.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(live_path))
    live.listen()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(stale_path))
    stale.close()  # the file stays, as after a SIGKILL
    try:
        local.remove_stale_sockets(before)
        assert live_path.exists() and older.exists() and not stale_path.exists()
    finally:
        live.close()

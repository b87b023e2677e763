"""The bootstrap's memory of the swarm across restarts (bootstrap/known_peers.py)."""

import json
import stat

from swarm_bootstrap.known_peers import MAX_PEERS, KnownPeers, peers_file_for


def test_only_verified_peers_are_remembered_and_a_restart_reads_them_back(tmp_path):
    path = peers_file_for(tmp_path / "bootstrap.key")
    assert path == tmp_path / "bootstrap.peers.json"
    known = KnownPeers(path)
    connected = {"QmA": ["/ip4/10.0.0.1/tcp/31338"], "QmForged": ["/ip4/10.0.0.9/tcp/1"],
                 "QmB": ["/ip4/10.0.0.2/tcp/31338", "/ip4/10.0.0.2/tcp/31338/p2p/QmB"]}
    known.note(connected, verified=["QmA", "QmB", "QmGone"])  # QmGone is verified but not connected
    known.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = KnownPeers(path).load()
    assert again == ["/ip4/10.0.0.2/tcp/31338/p2p/QmB", "/ip4/10.0.0.1/tcp/31338/p2p/QmA"]  # newest first


def test_the_list_is_bounded_and_keeps_the_most_recently_seen(tmp_path):
    known = KnownPeers(tmp_path / "p.json")
    for i in range(MAX_PEERS + 10):
        known.note({f"Qm{i}": [f"/ip4/10.0.{i // 256}.{i % 256}/tcp/1"]}, verified=[f"Qm{i}"])
    known.note({"Qm0": ["/ip4/10.9.9.9/tcp/1"]}, verified=["Qm0"])  # seen again: the newest
    assert len(known.peers) == MAX_PEERS and "Qm5" not in known.peers
    assert list(known.peers)[-1] == "Qm0"


def test_a_damaged_file_is_ignored_with_one_line(tmp_path, caplog):
    path = tmp_path / "p.json"
    for damaged in ("{not json", json.dumps([1, 2]), json.dumps({"peers": {"QmA": "not a list", 3: [4]}})):
        path.write_text(damaged)
        caplog.clear()
        assert KnownPeers(path).load() == []
    assert len([r for r in caplog.records if "ignoring the remembered peers" in r.message]) <= 1
    assert KnownPeers(tmp_path / "missing.json").load() == []


def test_nothing_is_written_when_nothing_changed(tmp_path):
    path = tmp_path / "p.json"
    known = KnownPeers(path)
    known.save()
    assert not path.exists()
    known.note({"QmA": ["/ip4/10.0.0.1/tcp/1"]}, verified=["QmA"])
    known.save()
    path.write_text("written by someone else")
    known.save()  # nothing new since the last save
    assert path.read_text() == "written by someone else"
    known.note({"QmB": ["/ip4/10.0.0.2/tcp/1"]}, verified=["QmB"])
    known.save()
    assert set(json.loads(path.read_text())["peers"]) == {"QmA", "QmB"}

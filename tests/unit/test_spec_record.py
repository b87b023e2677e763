"""The run-spec record, signer ids and identity files: what a joiner accepts from the
network, and what it refuses with which message."""

import dataclasses
import json
import os
import stat

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from swarm_node import __version__
from swarm_node.data.spec import DataSpec
from swarm_node.errors import ConfigError, IncompatibleRun, ProtocolError
from swarm_node.net.identity import ensure_identity, peer_id_of_identity, peer_id_of_owner, record_validator
from swarm_node.spec import RunSpec
from swarm_node.spec_record import SpecRecord, peer_ids_of


def test_spec_record_round_trip_and_parse():
    spec = RunSpec(run_id="r1", data=DataSpec(kind="synthetic"))
    record = SpecRecord.from_wire(SpecRecord.of(spec).to_wire())
    assert record.parse() == spec and record.spec_hash == spec.spec_hash()


def test_a_spec_that_hashes_differently_here_is_refused():
    spec = RunSpec(run_id="r1")
    raw = json.loads(spec.canonical_json())
    raw["seq_len"] += 1  # what two software versions reading one spec differently looks like
    record = dataclasses.replace(SpecRecord.of(spec), spec_json=json.dumps(raw))
    with pytest.raises(IncompatibleRun, match="hashes to"):
        record.parse()


def test_a_run_needing_a_newer_version_says_upgrade():
    record = dataclasses.replace(SpecRecord.of(RunSpec()), min_version="99.0")
    with pytest.raises(IncompatibleRun, match=rf"needs swarm-node >= 99.0; this is {__version__}: upgrade"):
        record.parse()


def test_a_spec_with_unknown_settings_says_upgrade():
    raw = {**json.loads(RunSpec().canonical_json()), "new_setting": 1}
    record = dataclasses.replace(SpecRecord.of(RunSpec()), spec_json=json.dumps(raw))
    with pytest.raises(IncompatibleRun, match="does not parse with swarm-node"):
        record.parse()


@pytest.mark.parametrize("path", ["/etc/passwd", "../secret.txt", "~/notes.txt", "data/../../x"])
def test_a_published_spec_cannot_name_files_outside_the_working_directory(path):
    spec = RunSpec(data=DataSpec(kind="text", path=path))
    with pytest.raises(IncompatibleRun, match="relative to the directory"):
        SpecRecord.of(spec).parse()
    assert SpecRecord.of(RunSpec(data=DataSpec(kind="text", path="data/train.txt"))).parse()


wire_values = st.one_of(st.none(), st.integers(), st.text(max_size=40), st.binary(max_size=20),
                        st.lists(st.integers(), max_size=3))


@given(st.one_of(wire_values, st.dictionaries(st.sampled_from(["run_id", "spec", "spec_hash", "min_version",
                                                               "x"]),
                                              st.one_of(wire_values, st.text(max_size=20_000)), max_size=6)))
@example({"run_id": "0", "spec": "0", "spec_hash": "0", "min_version": "\u00b9"})  # a non-ASCII digit
@example({"run_id": "0", "spec": "0", "spec_hash": "0", "min_version": "0"})  # a spec that is not an object
@settings(max_examples=2000, deadline=None)
def test_spec_records_from_the_network_parse_or_raise_typed_errors(raw):
    try:
        record = SpecRecord.from_wire(raw)
    except ProtocolError:
        return
    try:
        record.parse()
    except IncompatibleRun:
        pass


@given(st.text(max_size=200))
@settings(max_examples=500, deadline=None)
def test_owner_subkeys_that_are_not_keys_name_no_peer(text):
    # a 2048-bit key takes ~370 base64 characters: nothing this short can be one
    assert peer_id_of_owner(text) is None
    assert peer_id_of_owner(f"[owner:ssh-rsa {text}]") is None


def test_signer_id_is_the_peer_id_of_the_identity(tmp_path):
    path = tmp_path / "a.key"
    assert ensure_identity(path) is True
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400  # owner read-only
    owner = record_validator(path).local_public_key.decode()
    assert peer_id_of_owner(owner) == peer_id_of_identity(path)
    assert ensure_identity(path) is False  # reused, not replaced
    assert peer_id_of_owner(None) is None and peer_id_of_owner(owner[:-5] + "]") is None


def test_a_corrupt_identity_is_refused_with_its_path(tmp_path):
    path = tmp_path / "bad.key"
    path.write_bytes(b"not a key")
    with pytest.raises(ConfigError, match="bad.key is not a libp2p identity file"):
        ensure_identity(path)


def test_initial_peers_must_carry_their_peer_id():
    assert peer_ids_of(["/ip4/1.2.3.4/tcp/5/p2p/QmAbc"]) == ["QmAbc"]
    with pytest.raises(ConfigError, match="lacks its peer id"):
        peer_ids_of(["/ip4/1.2.3.4/tcp/5"])


def test_bootstrap_refuses_to_create_its_identity_inside_a_git_work_tree(tmp_path):
    from swarm_bootstrap.identity_policy import prepare_identity

    (tmp_path / "repo" / ".git").mkdir(parents=True)
    with pytest.raises(ConfigError, match="must never be committed"):
        prepare_identity(tmp_path / "repo" / "keys" / "boot.key")
    assert not (tmp_path / "repo" / "keys").exists()
    peer_id = prepare_identity(tmp_path / "elsewhere" / "boot.key")
    assert peer_id == prepare_identity(tmp_path / "elsewhere" / "boot.key")

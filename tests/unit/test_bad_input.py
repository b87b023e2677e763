"""What users type wrong (the rows of the bad-input review that were not answered well):
each mistake is answered with one line that names the setting and what to do, exit status
2, no traceback, and before any daemon starts or any file is created. Driven in-process
through the real entry points; two runs as subprocesses check the exit status and the
absence of a traceback as a user sees them."""

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from swarm_bootstrap import cli as bootstrap_cli

from swarm_node.cli import main as cli

REPO = Path(__file__).resolve().parents[2]
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
EXAMPLE_SPEC = str(REPO / "examples" / "debug-synthetic.toml")


@pytest.fixture
def scratch(tmp_path):
    """The scratch folder of the table: text, a binary file named .txt, bad tokenizers."""
    d = tmp_path / "d"
    (d / "txt").mkdir(parents=True)
    (d / "txt" / "a.txt").write_text("hello world. " * 600)
    (d / "bintxt").mkdir()
    (d / "bintxt" / "blob.txt").write_bytes(bytes((i * 131 + 7) % 256 for i in range(300_000)))
    (d / "highbytes").mkdir()  # binary without a NUL byte
    (d / "highbytes" / "blob.txt").write_bytes(b"text " + bytes(0x80 + i % 128 for i in range(50_000)))
    (d / "empty").mkdir()
    (d / "tok.json").write_text("not json\n")
    (d / "tok2.json").write_text("{}\n")
    (d / "outfile").write_text("x\n")
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    for name, text in {"zero": "num_stages = 0\n", "seq": "seq_len = 0\n", "typo": "num_stage = 2\n",
                       "str": 'num_stages = "2"\n', "inner": "[inner]\nlrr = 0.1\n"}.items():
        (cfg / f"{name}.toml").write_text(text)
    return tmp_path


def _refuse_to_start(*args, **kwargs):
    raise AssertionError("something was started: the input should have been refused before")


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    """No bootstrap, DHT, swarm or node process starts (join's node: ``on_node``)."""
    from swarm_bootstrap import peer

    from swarm_node.local import swarm as local

    monkeypatch.setattr(peer.BootstrapPeer, "run", _refuse_to_start)
    monkeypatch.setattr(local.SwarmDHT, "start", _refuse_to_start)
    monkeypatch.setattr(local.subprocess, "Popen", _refuse_to_start)
    monkeypatch.setattr(local.LocalSwarm, "_spawn_all", _refuse_to_start)


def _run(argv, capsys, program="swarm-node"):
    """(exit status, the lines on stderr) of one command, run in-process."""
    try:
        if program == "swarm-node":
            code = cli.main(argv, on_node=_refuse_to_start)
        else:
            code = bootstrap_cli.main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()


def _one_line(argv, capsys, *named, program="swarm-node"):
    code, lines = _run(argv, capsys, program)
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{program}") and "error:" in lines[0], lines
    for text in named:
        assert text in lines[0], (text, lines[0])
    return lines[0]


# -- 1. join, initial peers: checked before the daemon starts ---------------------------

@pytest.mark.parametrize("maddr, named", [
    ("/ip4/127.0.0.1/tcp/9/p2p/QmNotAPeerId", "'QmNotAPeerId' is not a peer id"),
    (f"/ip4/999.1.1.1/tcp/9/p2p/{PEER}", "'999.1.1.1' is not an IPv4 address"),
    ("/ip4/203.0.113.7/tcp/31337/p2p/QmThsS...", "'QmThsS...' is not a peer id"),  # the README's example
    ("/ip4/.../tcp/.../p2p/Qm...", "'...' is not an IPv4 address"),  # the README's placeholders
])
def test_a_bad_initial_peer_is_named_before_the_daemon_starts(scratch, capsys, maddr, named):
    line = _one_line(["join", "--port", "0", "--initial-peers", maddr], capsys, "--initial-peers", named)
    assert "could not start the DHT" not in line and "copy the whole multiaddr" in line
    if "..." in maddr:
        assert "stand for the real values" in line


def test_a_bad_listen_or_announce_address_of_join_is_named(capsys):
    _one_line(["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}", "--host-maddrs",
               "/ip4/127.0.0.1/tcp/99999"], capsys, "--host-maddrs", "not a tcp port")
    _one_line(["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}", "--public-ip", "1.2.3",
               "--port", "31338"], capsys, "--public-ip 1.2.3")


def test_the_multiaddrs_the_daemon_accepts_pass_the_check():
    from swarm_node.net.maddr import maddr_problem

    for good in (f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}", f"/ip6/::1/tcp/9/p2p/{PEER}", "/ip4/0.0.0.0/tcp/0",
                 f"/dns4/boot.example.org/tcp/31337/p2p/{PEER}", "/ip4/1.2.3.4/udp/5/quic",
                 "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGzh9D2PYR4wStA3Yt2bMHg1EACnvjbdGKmnWrEWPWEiL"):
        assert maddr_problem(good) is None, good


def test_a_host_name_that_does_not_resolve_is_said(monkeypatch):
    """Side note of the table: /dns4/boot.example.invalid said only 'none answered'
    (.invalid never resolves: RFC 6761)."""
    from swarm_node.net import dht

    async def silent(*args, **kwargs):
        raise dht._InitialPeersSilent("none of the initial peers answered (...)")

    monkeypatch.setattr(dht, "_start_dht", silent)
    with pytest.raises(dht._InitialPeersSilent, match=r"boot\.example\.invalid does not resolve here"):
        maddr = f"/dns4/boot.example.invalid/tcp/31337/p2p/{PEER}"
        asyncio.run(dht._start_dht_patiently({}, False, [maddr], 1.0))


# -- 2. join --config: the key and its value named -----------------------------------------

@pytest.mark.parametrize("name, named", [
    ("zero", "num_stages must be at least 1, got 0"),
    ("seq", "seq_len must be at least 2, got 0"),
    ("typo", "unknown key num_stage in the top-level table; did you mean num_stages?"),
    ("str", "num_stages must be an integer, got '2'"),
    ("inner", "unknown key lrr in [inner]; did you mean lr?"),
])
def test_a_bad_run_spec_names_the_key_and_its_value(scratch, capsys, name, named):
    path = scratch / "cfg" / f"{name}.toml"
    line = _one_line(["join", "--config", str(path)], capsys, str(path), named)
    assert "__init__" not in line and "not supported between" not in line


def test_a_run_spec_that_is_a_folder_is_one_line(scratch, capsys):
    _one_line(["join", "--config", str(scratch / "cfg")], capsys, "cannot read the run spec")


# -- 3. data prepare -------------------------------------------------------------------------

def _prepare(scratch, *extra):
    d = scratch / "d"
    return ["data", "prepare", f"text:{d / 'txt'}", "--out", str(d / "out"), "--no-progress", *extra]


@pytest.mark.parametrize("tokenizer, named", [
    ("tok.json", "is not a Hugging Face tokenizer.json"),
    ("tok2.json", "is not a Hugging Face tokenizer.json"),
    ("empty", "is a folder"),
    ("nope.json", "tokenizer file not found"),
])
def test_a_bad_tokenizer_is_named(scratch, capsys, tokenizer, named):
    pytest.importorskip("tokenizers")
    path = scratch / "d" / tokenizer
    _one_line(_prepare(scratch, "--tokenizer", str(path)), capsys, f"--tokenizer {path}", named)
    assert not (scratch / "d" / "out").exists()  # and no empty --out folder is left behind
    _one_line(["sim", "--tokenizer", str(path), "--no-progress"], capsys, f"--tokenizer {path}", named)


@pytest.mark.parametrize("folder", ["bintxt", "highbytes"])
def test_binary_data_in_a_text_source_is_refused(scratch, capsys, folder):
    d = scratch / "d"
    _one_line(["data", "prepare", f"text:{d / folder}", "--out", str(d / "out6"), "--shard-tokens", "100000",
               "--no-progress"], capsys, str(d / folder / "blob.txt"), "not UTF-8 text")
    _one_line(["local", "--data", f"text:{d / folder}", "--no-progress"], capsys, "check --data",
              str(d / folder / "blob.txt"))
    help_text = _subparser("data", "prepare").format_help()
    assert "refused as" in help_text and "binary" in help_text


def test_a_few_stray_bytes_in_a_text_file_are_replaced_not_refused(tmp_path):
    from swarm_node.data.dataset import read_text_file

    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9 ".encode("latin-1") + b"plain text " * 100)
    assert read_text_file(path).startswith("caf\ufffd ")


def test_an_out_folder_that_is_a_file_is_named(scratch, capsys):
    out = scratch / "d" / "outfile"
    argv = _prepare(scratch)
    argv[argv.index("--out") + 1] = str(out)
    _one_line(argv, capsys, f"--out {out} is a file")


def test_a_failed_prepare_leaves_no_empty_out_folder(scratch, capsys):
    d = scratch / "d"
    _one_line(["data", "prepare", f"text:{d / 'nonexistent'}", "--out", str(d / "out1"), "--no-progress"],
              capsys, "text data not found")
    assert not (d / "out1").exists()


# -- 4. local ------------------------------------------------------------------------------

def test_a_run_dir_that_is_a_file_is_named(scratch, capsys):
    out = scratch / "d" / "outfile"
    _one_line(["local", "--run-dir", str(out), "--no-progress"], capsys, f"--run-dir {out} is a file")
    _one_line(["local", "--checkpoint-dir", str(out / "deeper"), "--no-progress"], capsys,
              "--checkpoint-dir", f"inside {out}, which is a file")
    _one_line(["join", "--config", EXAMPLE_SPEC, "--run-dir", str(out)], capsys, f"--run-dir {out} is a file")


def test_a_negative_lr_names_the_flag(capsys):
    code, lines = _run(["local", "--lr", "-1"], capsys)
    assert code == 2 and "argument --lr: must be positive, got -1" in lines[-1]


# -- 5. swarm-bootstrap -------------------------------------------------------------------

def _bootstrap(argv, capsys, *named):
    return _one_line(argv, capsys, *named, program="swarm-bootstrap")


def test_the_bootstrap_checks_its_data_folder(scratch, capsys):
    missing, empty = scratch / "d" / "nonexistent", scratch / "d" / "empty"
    key = str(scratch / "b.key")
    _bootstrap(["--identity", key, "--run-spec", EXAMPLE_SPEC, "--data", str(missing)], capsys,
               f"--data {missing} does not exist")
    _bootstrap(["--identity", key, "--run-spec", EXAMPLE_SPEC, "--data", str(empty)], capsys,
               f"--data {empty} holds no manifest.json")
    assert not (scratch / "b.key").exists()


def test_the_bootstrap_port_is_checked_and_used_without_public_ip(scratch, capsys):
    _bootstrap(["--identity", str(scratch / "b.key"), "--port", "99999", "--run-spec",
                str(scratch / "cfg" / "nope.toml")], capsys, "--port 99999 is not a TCP port")
    args = bootstrap_cli.build_parser().parse_args(["--port", "31400"])
    assert bootstrap_cli._addresses(args) == (("/ip4/0.0.0.0/tcp/31400",), ())
    args = bootstrap_cli.build_parser().parse_args([])
    assert bootstrap_cli._addresses(args) == (("/ip4/0.0.0.0/tcp/31337",), ())


def test_the_bootstrap_host_maddrs_are_checked(scratch, capsys):
    _bootstrap(["--identity", str(scratch / "b.key"), "--host-maddrs", "/ip4/127.0.0.1/tcp/99999",
                "--run-spec", EXAMPLE_SPEC], capsys, "--host-maddrs /ip4/127.0.0.1/tcp/99999",
               "not a tcp port")
    _bootstrap(["--identity", str(scratch / "b.key"), "--initial-peers", f"/ip4/999.1.1.1/tcp/9/p2p/{PEER}"],
               capsys, "--initial-peers", "'999.1.1.1' is not an IPv4 address")


def test_a_port_above_65535_in_a_listen_address_is_a_config_error():
    from swarm_node.errors import ConfigError
    from swarm_node.net.ports import refuse_taken_ports

    with pytest.raises(ConfigError, match="99999 is not a TCP port"):
        refuse_taken_ports(["/ip4/127.0.0.1/tcp/99999"])


def test_an_identity_under_a_file_or_a_folder_is_named(scratch, capsys):
    under_file = scratch / "d" / "outfile" / "b.key"
    _bootstrap(["--identity", str(under_file), "--run-spec", EXAMPLE_SPEC], capsys,
               f"--identity {under_file}", "is a file, not a folder")
    folder = scratch / "d" / "empty"
    line = _bootstrap(["--identity", str(folder), "--run-spec", EXAMPLE_SPEC], capsys,
                      f"--identity {folder} is a folder")
    assert "chmod" not in line


def test_the_bootstrap_refuses_a_missing_run_spec_before_it_creates_its_key(scratch, capsys):
    key = scratch / "boot" / "b.key"
    _bootstrap(["--identity", str(key)], capsys, "give --run-spec")
    _bootstrap(["--identity", str(key), "--run-spec", str(scratch / "cfg" / "nope.toml")], capsys,
               "run spec file not found")
    assert not key.exists() and not key.parent.exists()


# -- 6. export / generate -----------------------------------------------------------------

@pytest.mark.parametrize("command", [["export", "--out", "model1"], ["generate", "--prompt", "hi"]])
@pytest.mark.parametrize("checkpoint", ["ckpt-stage0", "nockpt"])
def test_a_checkpoint_that_does_not_exist_is_said(tmp_path, monkeypatch, capsys, command, checkpoint):
    monkeypatch.chdir(tmp_path)
    _one_line([command[0], "--checkpoint", f"{checkpoint}/", *command[1:]], capsys,
              f"--checkpoint {checkpoint} does not exist")
    assert not (tmp_path / "model1").exists()


# -- 7. help texts state their defaults -----------------------------------------------------

def _subparser(*names) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    for name in names:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _help_of(parser: argparse.ArgumentParser, flag: str) -> str:
    action = next(a for a in parser._actions if flag in a.option_strings)
    return parser._get_formatter()._expand_help(action)


@pytest.mark.parametrize("parser, flags", [
    (lambda: _subparser("probe"), ["--timeout", "--security"]),
    (bootstrap_cli.build_parser, ["--port", "--http-port", "--http-host", "--startup-timeout"]),
    (lambda: _subparser("join"), ["--http-host", "--device", "--max-steps"]),
    (lambda: _subparser("generate"), ["--top-k"]),
])
def test_help_texts_state_their_defaults(parser, flags):
    built = parser()
    for flag in flags:
        assert "default" in _help_of(built, flag), flag


def test_every_flag_with_a_default_says_it():
    """Of the commands the table read: a flag whose default is a value says what it is."""
    parsers = [bootstrap_cli.build_parser(), _subparser("join"), _subparser("probe"), _subparser("generate"),
               _subparser("export"), _subparser("data", "prepare")]
    silent = [f"{p.prog} {a.option_strings[0]}" for p in parsers for a in p._actions
              if a.option_strings and a.default not in (None, False, [], argparse.SUPPRESS)
              and "default" not in p._get_formatter()._expand_help(a)]
    assert not silent, silent


def test_the_data_command_has_a_description():
    assert _subparser("data").description


# -- as a user runs them ---------------------------------------------------------------------

def _subprocess(module, argv, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


def test_as_a_user_runs_them_exit_status_2_and_no_traceback(scratch, monkeypatch):
    pytest.importorskip("tokenizers")
    monkeypatch.undo()  # nothing_starts: these are separate processes, and subprocess.Popen is needed
    d = scratch / "d"
    done = _subprocess("swarm_node", ["data", "prepare", f"text:{d / 'txt'}", "--out", str(d / "o"),
                                      "--tokenizer", str(d / "tok.json")], scratch)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"swarm-node data: error: --tokenizer {d / 'tok.json'} is not a Hugging Face tokenizer.json "
        "(expected ident at line 1 column 2): give the model's tokenizer.json "
        "(tokenizer.save(PATH) writes one)"]
    done = _subprocess("swarm_bootstrap", ["--identity", str(scratch / "b.key"), "--host-maddrs",
                                           "/ip4/127.0.0.1/tcp/99999", "--run-spec", EXAMPLE_SPEC], scratch)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "--host-maddrs" in done.stderr

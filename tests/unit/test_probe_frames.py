"""The probe's own frame code (swarm_node/probe/probe_frames.py: the probe cannot import
swarm_node) against the node's codec: each decodes exactly what the other encodes, and
the status request is byte for byte the worked example of docs/PROTOCOL.md."""

import re
from pathlib import Path

import msgpack
import pytest
import torch

from swarm_node.cli.main import main
from swarm_node.net import protocols
from swarm_node.obs.endpoints import STATUS_REQUEST_LIMITS
from swarm_node.probe import probe_frames as probe
from swarm_node.wire.frames import DTYPES, WIRE_VERSION, decode_frame, encode_frame

REPO = Path(__file__).resolve().parents[2]
STATUS = {"kind": "status", "ok": True, "run_id": "debug-synthetic", "spec_hash": "c498fdf4549656bf",
          "version": "0.1.0", "peer_id": "QmNTKtsSjNdoqnyC1yS4oyejTtcuv9wFsXzWzetCtSCUaD", "stage": 0,
          "num_stages": 2, "state": "training", "inner_step": 12, "outer_round": 1, "peers_per_stage": [1, 2]}


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, generator=g), torch.randn(4, generator=g).to(torch.bfloat16),
            torch.randn(1, 2, 2, generator=g).half(), torch.arange(6, dtype=torch.int32).reshape(3, 2),
            torch.arange(3, dtype=torch.int64), torch.tensor([1, 255], dtype=torch.uint8), torch.zeros(0, 5)]


def _raw(t: torch.Tensor) -> bytes:
    return (t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t).numpy().tobytes()


def test_the_probe_speaks_the_nodes_constants():
    assert probe.STATUS_PROTOCOL == protocols.STATUS
    assert probe.WIRE_VERSION == WIRE_VERSION
    assert probe.DTYPE_SIZES == {name: dtype.itemsize for name, dtype in DTYPES.items()}


def test_the_status_request_is_what_the_node_accepts_and_what_the_docs_show():
    request = probe.status_request()
    assert int.from_bytes(request[:probe.LENGTH_BYTES], "big") == len(request) - probe.LENGTH_BYTES
    header, tensors = decode_frame(request[probe.LENGTH_BYTES:], STATUS_REQUEST_LIMITS)
    assert header == {"v": 1, "kind": "status"} and tensors == []
    assert request[probe.LENGTH_BYTES:] == encode_frame({"kind": "status"})
    doc = (REPO / "docs" / "PROTOCOL.md").read_text()
    example = re.search(r"<!-- status-request-bytes -->\n```\n(.*?)```", doc, re.DOTALL)
    assert example, "docs/PROTOCOL.md lost its worked example"
    documented = bytes.fromhex(" ".join(line.split("|")[0] for line in example.group(1).splitlines()))
    assert documented == request


def test_the_probe_decodes_what_the_codec_encodes():
    tensors = _tensors()
    header, decoded = probe.decode_frame(encode_frame({"kind": "outer", "round": 3, "ok": True}, tensors))
    assert header == {"kind": "outer", "round": 3, "ok": True}
    assert [(d, s) for d, s, _ in decoded] == [(probe_name(t), tuple(t.shape)) for t in tensors]
    assert [raw for _, _, raw in decoded] == [_raw(t) for t in tensors]


def test_the_codec_decodes_what_the_probe_encodes():
    tensors = _tensors()
    frame = probe.encode_frame({"kind": "fwd", "spec": "abc"},
                               [(probe_name(t), t.shape, _raw(t)) for t in tensors])
    header, decoded = decode_frame(frame)
    assert header == {"v": 1, "kind": "fwd", "spec": "abc"}
    for got, want in zip(decoded, tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_status_answer_parses_and_failures_read_as_one_line():
    assert probe.parse_status(encode_frame(STATUS)) == STATUS
    with pytest.raises(probe.ProbeFailure, match="^busy"):
        probe.parse_status(b"")
    with pytest.raises(probe.ProbeFailure, match="answered an error.*protocol"):
        probe.parse_status(encode_frame({"kind": "status", "ok": False, "error": "protocol"}))
    with pytest.raises(probe.ProbeFailure, match="field 'stage'"):
        probe.parse_status(encode_frame({**STATUS, "stage": "zero"}))
    with pytest.raises(probe.ProbeFailure, match="not a status frame"):
        probe.parse_status(encode_frame({**STATUS, "kind": "fwd"}))
    with pytest.raises(probe.ProbeFailure, match="bad answer"):
        probe.parse_status(b"\x05\x00\x00\x00garbage")
    line = probe.verdict({"status": STATUS, "ping_ms": 1.5, "security": "noise"})
    assert line.startswith(f"OK: node {STATUS['peer_id']} of run 'debug-synthetic'") and "\n" not in line


BAD_FRAMES = {
    "shorter than the header length": b"\x01\x00",
    "header longer than the frame": b"\xff\xff\x00\x00" + b"x" * 8,
    "payload cut short": encode_frame({"kind": "x"}, [torch.zeros(3)])[:-1],
    "bytes after the last tensor": encode_frame({"kind": "x"}) + b"\x00",
    "another frame version": probe.HEADER_LEN.pack(4) + msgpack.packb({"v": 2}),
    "not msgpack": probe.HEADER_LEN.pack(1) + b"\xc1",
}


@pytest.mark.parametrize("frame", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_bad_frames_raise_frame_errors(frame):
    with pytest.raises(probe.FrameError):
        probe.decode_frame(frame)


def test_uvarint():
    assert probe.decode_uvarint(b"\x05rest") == (5, 1)
    assert probe.decode_uvarint(b"\xac\x02") == (300, 2)
    with pytest.raises(ValueError):
        probe.decode_uvarint(b"\x80\x80")


def test_probe_without_its_environment_says_how_to_set_it_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SWARM_PROBE_VENV", str(tmp_path / "missing"))
    assert main(["probe", "/ip4/127.0.0.1/tcp/1/p2p/QmNTKtsSjNdoqnyC1yS4oyejTtcuv9wFsXzWzetCtSCUaD"]) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "run `swarm-node probe --setup`" in lines[0]


def probe_name(t: torch.Tensor) -> str:
    return {v: k for k, v in DTYPES.items()}[t.dtype]

"""The outer round never asks which pairing it runs (issue 53): NoLoCo's pairs and
DiLoCo's group are one interface (gossip/round_pairing.py), and the round
(gossip/exchange.py) and the payloads (gossip/payloads.py) only call it. Read from
their source, so that a branch on the kind put back fails here whichever way it is
written: by class, by method name, or by asking the pairing what it is."""

import ast
from pathlib import Path

import pytest

GOSSIP = Path(__file__).resolve().parents[2] / "swarm_node" / "gossip"
KINDS = {"GroupRound", "PairingCoordinator", "GroupPairing", "PairPairing", "PairResult"}
METHOD_NAMES = {"noloco", "diloco"}
ASKING = {"isinstance", "issubclass", "type", "hasattr", "getattr"}


def kind_checks(source: str) -> list[str]:
    """Every place in ``source`` that names a pairing kind (as code or as a string),
    names a method, or asks the pairing about its type or its attributes: "line: what",
    in line order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        named = getattr(node, "id", None) or getattr(node, "attr", None)
        if isinstance(node, ast.Name | ast.Attribute) and named in KINDS:
            found.append(f"{line}: names {ast.unparse(node)}")
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in KINDS:
            found.append(f"{line}: imports {node.name}")
        elif isinstance(node, ast.Constant) and node.value in KINDS | METHOD_NAMES:
            found.append(f"{line}: names {node.value!r}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ASKING
              and node.args and "pairing" in ast.unparse(node.args[0])):
            found.append(f"{line}: {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


@pytest.mark.parametrize("module", ["exchange.py", "payloads.py"])
def test_the_round_and_its_payloads_never_ask_which_pairing_runs(module):
    assert kind_checks((GOSSIP / module).read_text()) == []


def test_the_check_finds_each_way_of_asking():
    source = '''
from swarm_node.gossip.group import GroupRound
if isinstance(self.pairing, GroupRound): pass
if method == "diloco": pass
if hasattr(self.pairing, "most_sharing"): pass
peer = getattr(self.pairing, "abandoned", None)
if type(self.pairing).__name__ == "PairPairing": pass
'''
    assert [f.split(":")[0] for f in kind_checks(source)] == ["2", "3", "3", "4", "5", "6", "7", "7"]

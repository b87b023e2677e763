"""The layer map of docs/ARCHITECTURE.md ("Layers") holds for the code: each package or
top-level module of swarm_node/ imports only itself and the rows below its own, never a
row above nor another entry of its row; every one of them is on the map; and no module
imports one that imports it back. Imports under TYPE_CHECKING and inside functions count:
they name the same dependency."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "swarm_node"
MAP = REPO / "docs" / "ARCHITECTURE.md"
ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|", re.M)


def layer_map(text: str) -> dict[str, int]:
    """{entry: layer} from the table under the "Layers" heading: an entry is a package
    (``net/``) or a top-level module (``spec.py``) of swarm_node/."""
    section = re.search(r"^#+ Layers\n(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert section, f"{MAP.name} has no Layers section"
    layers = {}
    for number, cell in ROW.findall(section.group(1)):
        for entry in re.findall(r"`([^`]+)`", cell):
            assert entry not in layers, f"{entry} is on two rows of the layer map"
            layers[entry] = int(number)
    assert layers, "the Layers section holds no table rows"
    return layers


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def entry_of(module: str) -> str:
    """The map's entry a module of swarm_node belongs to."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def resolve(name: str, modules: set[str]) -> str | None:
    """The longest module of swarm_node that ``name`` starts with (a name imported from a
    module is not a module of its own)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module of swarm_node) of every import in the file, wherever it stands."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = resolve(name, modules) if name.startswith("swarm_node") else None
            if target is not None and target != own:
                found.append((node.lineno, target))
    return found


@functools.cache
def graph() -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    files = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    return files, {module: imports(path, set(files)) for module, path in files.items()}


def upward_imports(layers: dict[str, int]) -> list[str]:
    files, edges = graph()
    wrong = []
    for module, targets in edges.items():
        entry = entry_of(module)
        for line, target in targets:
            other = entry_of(target)
            if other != entry and layers.get(other, 0) >= layers.get(entry, 0):
                where = f"{files[module].relative_to(REPO)}:{line}"
                wrong.append(f"{where} imports {target}: {entry} is on layer {layers.get(entry)}, "
                             f"{other} on layer {layers.get(other)}")
    return wrong


def circles() -> list[list[str]]:
    """The groups of modules that reach each other through their imports (Tarjan)."""
    _, edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for _, target in edges[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                group.append(stack.pop())
                if group[-1] == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in edges:
        if module not in index:
            visit(module)
    return found


def test_every_package_and_top_level_module_is_on_the_layer_map():
    layers = layer_map(MAP.read_text())
    present = {entry_of(module) for module in graph()[0]}
    unmapped, gone = sorted(present - set(layers)), sorted(set(layers) - present)
    assert not unmapped, f"not on the layer map of {MAP.name}: {unmapped}"
    assert not gone, f"on the layer map but not in swarm_node/: {gone}"


def test_imports_point_down_the_layer_map():
    wrong = upward_imports(layer_map(MAP.read_text()))
    assert not wrong, "imports against the layer map:\n" + "\n".join(wrong)


def test_no_module_imports_one_that_imports_it_back():
    assert circles() == []


def test_the_check_finds_an_import_up_the_map():
    """The map read in reverse: every import between two rows runs up it."""
    layers = layer_map(MAP.read_text())
    top = max(layers.values()) + 1
    reversed_map = {entry: top - layer for entry, layer in layers.items()}
    wrong = upward_imports(reversed_map)
    assert any("swarm_node/node/conductor.py" in line and "swarm_node.train.worker" in line for line in wrong)

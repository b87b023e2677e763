"""Byte-compile what swarm-node and its tests import, once, right after an install.

dev.sh installs with pip's --no-compile: compiling every module of torch, scipy and
sympy took about half the install's CPU, and a node imports a small part of them. What
it does import is compiled here, so that no process compiles it again, even where
PYTHONDONTWRITEBYTECODE is set (as on some CI machines), which would otherwise make
every node process compile torch from source."""

import importlib
import pkgutil
import sys

sys.dont_write_bytecode = False  # this process writes the caches the others read

PROJECT_PACKAGES = ("swarm_node", "swarm_bootstrap")
TEST_TOOLS = ("pytest", "xdist", "pytest_timeout", "hypothesis")
LAZY_IMPORTS = ("scipy.optimize",)  # swarm_node/net/__init__.py loads it on first use


def main() -> None:
    names = []
    for package_name in PROJECT_PACKAGES:
        package = importlib.import_module(package_name)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, package_name + ".")
                  if not m.name.endswith("__main__")]
    for name in [*names, *LAZY_IMPORTS, *TEST_TOOLS]:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional extra that is not installed (the slow tier's, say)
            pass


if __name__ == "__main__":
    main()

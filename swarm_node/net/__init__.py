"""The network layer: the only code that imports hivemind.

hivemind's package import pulls in ``scipy.optimize`` (for its averager's load balancing,
which we never use): 0.6 s of CPU in every node process, a fifth of its start-up. So it
is imported on first use instead."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

DEFERRED_MODULES = ("scipy.optimize",)


class _ImportedOnFirstUse(types.ModuleType):
    """Stands in for a module until one of its names is used. Dunder lookups do not load
    it: torch's own imports call inspect.getmodule, which probes every module's
    ``__file__``, and that alone would import it at once."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)


def _defer(name: str) -> None:
    top = name.partition(".")[0]
    if name in sys.modules or importlib.util.find_spec(top) is None:
        return
    sys.modules[name] = _ImportedOnFirstUse(name)


for _name in DEFERRED_MODULES:
    _defer(_name)

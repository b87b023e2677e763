"""Writing the Prometheus text exposition format (version 0.0.4), for the bootstrap's and
the nodes' /metrics endpoints."""

from __future__ import annotations

import math


class PrometheusText:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        """One metric family; counters get the conventional ``_total`` suffix."""
        if kind == "counter":
            name += "_total"
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            self._lines.append(
                f"{name}{{{label_text}}} {_number(value)}" if labels else f"{name} {_number(value)}"
            )

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(int(value))

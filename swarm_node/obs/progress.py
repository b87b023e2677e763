"""Progress bars for training runs and their final evaluation (tqdm on a terminal,
sparse lines otherwise)."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm


def _redraw_interval_s() -> float:
    # On a non-terminal (CI logs) redraw rarely so logs stay short.
    return 0.2 if sys.stderr.isatty() else 15.0


class TrainingProgress:
    def __init__(self, total_steps: int, description: str, enabled: bool = True):
        self.bar = tqdm(total=total_steps, desc=description, unit="step", disable=not enabled,
                        mininterval=_redraw_interval_s(), dynamic_ncols=True, file=sys.stderr)
        self.last_val: float | None = None

    def update(self, step: int, tokens: int, train_loss: float | None, val_loss: float | None,
               elapsed_s: float) -> None:
        """``train_loss`` is None until there is one (a swarm's last stage reports its first
        loss some seconds after stage 0 starts); the bar then shows no loss rather than a
        placeholder."""
        if val_loss is not None:
            self.last_val = val_loss
        postfix = {}
        if train_loss is not None:
            postfix["loss"] = f"{train_loss:.3f}"
        postfix["tok/s"] = f"{tokens / max(elapsed_s, 1e-9):,.0f}"
        if self.last_val is not None:
            postfix["val"] = f"{self.last_val:.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(step - self.bar.n)

    def finish(self, step: int) -> None:
        """Show the last step reached, so the bar does not stop short of where the run did."""
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class EvaluationProgress:
    """The final evaluation of several model paths: a bar of validation batches on a
    terminal, and one log line per path wherever the output goes."""

    def __init__(self, paths: int, batches_per_path: int, log: logging.Logger, enabled: bool = True):
        self.paths = paths
        self.log = log
        self.done = 0
        self.bar = tqdm(total=paths * batches_per_path, desc="final evaluation", unit="batch",
                        disable=not enabled or not sys.stderr.isatty(), mininterval=_redraw_interval_s(),
                        dynamic_ncols=True, file=sys.stderr, leave=False)

    def start(self, what: str) -> None:
        self.bar.set_description(f"evaluating {what} ({self.done + 1} of {self.paths})", refresh=False)

    def advance(self) -> None:
        self.bar.update(1)

    def finished(self, what: str, loss: float, seconds: float) -> None:
        self.done += 1
        self.bar.clear()  # the log line must not land inside the bar
        self.log.info("evaluated %s (%d of %d): val loss %.4f in %.1f s", what, self.done, self.paths, loss, seconds)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

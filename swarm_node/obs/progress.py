"""A progress bar for training runs (tqdm on a terminal, sparse lines otherwise)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class TrainingProgress:
    def __init__(self, total_steps: int, description: str, enabled: bool = True):
        # On a non-terminal (CI logs) redraw rarely so logs stay short.
        interval = 0.2 if sys.stderr.isatty() else 15.0
        self.bar = tqdm(total=total_steps, desc=description, unit="step", disable=not enabled,
                        mininterval=interval, dynamic_ncols=True, file=sys.stderr)
        self.last_val: float | None = None

    def update(self, step: int, tokens: int, train_loss: float, val_loss: float | None, elapsed_s: float) -> None:
        if val_loss is not None:
            self.last_val = val_loss
        postfix = {"loss": f"{train_loss:.3f}", "tok/s": f"{tokens / max(elapsed_s, 1e-9):,.0f}"}
        if self.last_val is not None:
            postfix["val"] = f"{self.last_val:.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()

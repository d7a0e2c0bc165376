"""Stopping a run whose training loss climbs back while it is still finite.

A compressed run can diverge slowly: the training loss climbs over hundreds of steps, every
value finite, so ``nan_policy`` never sees it (``docs/guide.md``). :class:`DivergenceGuard`
watches the loss ``gradpress train`` logs and stops such a run early:

1. Average the training loss over consecutive windows of ``window`` steps.
2. Keep the first window's mean (where training started) and the lowest window mean so far.
3. After each window, raise :class:`TrainingDiverged` if its mean has climbed back ``fraction``
   of the way from the lowest towards the first: ``mean > low + fraction * (first - low)``.

The test is relative to the run's own loss scale, so it suits a language model's loss of 4 as
well as a classifier's of 0.01; a run that never improved on its first window is never stopped.
Only rank 0 decides (its shard's loss): it ends with status ``failed`` and the reason, and the
launcher stops the other processes.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["DivergenceGuard", "TrainingDiverged", "WINDOW"]

#: Steps per averaging window.
WINDOW = 50


class TrainingDiverged(RuntimeError):
    """The training loss climbed back past the guard's threshold (step 3)."""


class DivergenceGuard:
    """Step 1-3 of the module docstring on one worker's losses.

    Args:
        fraction: how far back towards the first window's mean the loss may climb, > 0
            (0.5: half-way; 1: back to where it started). Rule of thumb: 0.5 stops a diverging
            run a few hundred steps after its mean starts to climb, far above what a healthy
            run climbs back (a few hundredths of the way); lower stops sooner.
        window: steps per averaging window, >= 1.
    """

    def __init__(self, fraction: float, window: int = WINDOW) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not math.isfinite(fraction) or fraction <= 0:
            raise ValueError(f"DivergenceGuard fraction must be a finite number > 0, got "
                             f"{fraction!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"DivergenceGuard window must be an int >= 1, got {window!r}")
        self.fraction, self.window = float(fraction), window
        self.first: float | None = None
        self.low = math.inf
        self._sum, self._n = 0.0, 0

    def observe(self, loss: float, step: int) -> None:
        """Add one step's loss; raises :class:`TrainingDiverged` at the end of a window whose
        mean is past the threshold."""
        # 1. the window's sum
        self._sum, self._n = self._sum + float(loss), self._n + 1
        if self._n < self.window:
            return
        mean, self._sum, self._n = self._sum / self._n, 0.0, 0
        # 2. the first and the lowest window means
        if self.first is None:
            self.first = self.low = mean
            return
        # 3. climbed back too far?
        limit = self.low + self.fraction * (self.first - self.low)
        if self.low < self.first and mean > limit:
            raise TrainingDiverged(
                f"training loss diverged: its mean over steps {step - self.window + 1}-{step} "
                f"is {mean:.4g}, past {limit:.4g} ({self.fraction:g} of the way back from its "
                f"lowest {self.window}-step mean {self.low:.4g} to its first {self.first:.4g}); "
                f"lower the lr or add weight decay (docs/guide.md)")
        self.low = min(self.low, mean)

    def state_dict(self) -> dict[str, Any]:
        """The guard's state (the hyperparameters are not part of it)."""
        return {"first": self.first, "low": self.low, "sum": self._sum, "n": self._n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state."""
        self.first, self.low = state["first"], float(state["low"])
        self._sum, self._n = float(state["sum"]), int(state["n"])

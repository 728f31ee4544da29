"""A run whose loss is no longer a finite number: its weights are lost. Every later step
would be NaN, and a retry from its last checkpoint takes the same steps (each is a function
of the seed) and diverges again, so the job ends dead with the step it went at, instead of
training on NaN or spending its attempts. No torch here: the worker maps a rank's report of
it back to this error (ranks/processes.py)."""

import math
from typing import Any

# A loss that is not finite this many steps in a row is a divergence; a single step's (an
# fp16 forward that overflowed, whose update the gradient scaler skips) is not.
NOT_FINITE_IN_A_ROW = 3


class Diverged(Exception):
    """The run's loss stayed not finite: the job ends dead, not retried."""


class DivergenceWatch:
    """Follows the losses as their windows are read (no read of the device of its own)."""

    def __init__(self) -> None:
        self._since: tuple[int, float] | None = None  # the streak's first step, and its loss
        self._streak = 0

    def see(self, steps: list[dict[str, Any]]) -> None:
        """Raises Diverged once the loss has not been finite NOT_FINITE_IN_A_ROW steps."""
        for step in steps:
            if math.isfinite(step["loss"]):
                self._since, self._streak = None, 0
                continue
            self._since = self._since or (step["step"], step["loss"])
            self._streak += 1
            if self._streak == NOT_FINITE_IN_A_ROW:
                first, loss = self._since
                raise Diverged(
                    f"the loss is {loss} at step {first} and not finite since: the run"
                    " diverged; a retry from its last checkpoint would too. Start again from"
                    f" a checkpoint before step {first} (--resume-from RUN@STEP) with a lower"
                    " --lr, a longer --lr-warmup or --max-grad-norm"
                )

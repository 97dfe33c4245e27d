"""Timing the parts of one decoding step (drafting, packing, forward, verifying, committing)."""
from __future__ import annotations

import time

# the parts a decoding step laps (engine.session), in order; pack_s only where the runner packed apart
STEP_PARTS = ("draft_s", "pack_s", "forward_s", "verify_s", "commit_s")


class StepClock:
    """Times the parts of one step; ``times`` holds seconds per part (``pack_s`` reported apart from
    ``forward_s``)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.times: dict[str, float] = {}

    def lap(self, part: str, pack_s: float = 0.0) -> None:
        """The time since the last lap (less ``pack_s``) is ``part``'s (added, where it has some)."""
        now = time.perf_counter()
        self.times[part] = self.times.get(part, 0.0) + now - self.t - pack_s
        if pack_s:
            self.times["pack_s"] = pack_s
        self.t = now

    def skip(self) -> None:
        """Leave the time since the last lap out of every part (work that is not the step's)."""
        self.t = time.perf_counter()

"""What the auto budget knows for sure: acceptance with confidence intervals, and measured speed.

The budget's point estimates (:class:`~logitspec.spec_decode.budget.AcceptanceStats`) are what it sizes
trees from; they move after one or two verified steps, and a budget that stops drafting on such
thin evidence never learns otherwise. Two checks keep it honest:

- :class:`FirstNodeEvidence`: per (acceptance state, draft kind), how often a draft's first node
  (a child of the root) was accepted when it was verified, as decayed counts with a Wilson interval.
  While the interval's upper end is at or above the break-even rate (the acceptance a draft token
  needs to pay at this batch), the evidence that drafts of that kind do not pay is not sound, and
  the policy verifies one node of such rows (a probe) even where the point estimate says none.
  Counts decay every step (``DECAY``), so evidence ages and a kind is re-checked on a schedule no
  run of bad luck can stop.
- :class:`SpeedGuard`: the measured speed of steps that may draft (the budget decides) against steps
  that decode plainly, per batch-size class, interleaved (tokens per row per plain step's curve time,
  so steps of different row counts in one class compare fairly). Drafting is turned off only
  when the interval of the difference says plain decoding is faster. While drafting wins, plain
  steps are still taken now and then, at intervals that double while the verdict holds
  (``RECHECK_FIRST`` .. ``RECHECK_LAST``); while plain wins, every ``RECHECK_DRAFT``-th step may draft.
  The two are not alike: a drafting step the budget sizes costs little more than a plain one where
  drafts do not pay, and a plain step costs two thirds of a step where they pay 3x; a verdict reached
  on one answer must not hold through the next (one answer's drafts lost 15%, the next's won 3x: a
  guard re-checking drafting at doubling intervals decoded up to 121 of the next 150 steps plainly,
  ``test_the_guard_resumes_drafting_within_a_few_steps_once_it_pays``). This is what makes the auto
  budget never a net loss: whatever the cost curve and the rates get wrong, the clock does not.
"""
from __future__ import annotations

import math

import numpy as np

from logitspec.spec_decode.budget import Verified
from logitspec.spec_decode.feedback import class_rows, size_class
from logitspec.spec_decode.tree import DraftTree

Z = 1.645  # one-sided 95%
DECAY = 0.995  # per step: counts halve in about 140 steps
MIN_ARM_STEPS = 6.0  # steps each mode needs before the guard compares them
RECHECK_FIRST, RECHECK_LAST = 8, 64  # steps between plain steps while drafting wins, doubling while it does
RECHECK_DRAFT = 6  # steps between drafting steps while plain decoding wins
ARM_DECAY = 0.97  # per sample of a mode: its speed is a mean over about its last 30 steps


def first_nodes(tree: DraftTree) -> np.ndarray:
    """int64 [k]: the draft's first nodes (the root's children)."""
    return np.flatnonzero(tree.parents[1:] == 0) + 1


def wilson(hits: float, tries: float, z: float = Z) -> tuple[float, float]:
    """The Wilson score interval of a rate from (possibly fractional, decayed) counts; (0, 1) when
    nothing was tried."""
    if tries <= 0:
        return 0.0, 1.0
    p = hits / tries
    den = 1 + z * z / tries
    mid = (p + z * z / (2 * tries)) / den
    half = z * math.sqrt(max(p * (1 - p) / tries + z * z / (4 * tries * tries), 0.0)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


class FirstNodeEvidence:
    """Decayed counts of first draft nodes verified and accepted, per (state, kind)."""

    def __init__(self, n_states: int, n_kinds: int, decay: float = DECAY):
        self.decay = decay
        self.hits = np.zeros((n_states, n_kinds))
        self.tries = np.zeros((n_states, n_kinds))
        self.steps = 0

    def age(self) -> None:
        """One step passed: every count decays."""
        self.hits *= self.decay
        self.tries *= self.decay
        self.steps += 1

    def update(self, tree: DraftTree, path, state: int) -> None:
        """The root's children were tested; the one on ``path`` (if any) passed."""
        self.update_step(Verified.of([tree], [path], [state]))

    def update_step(self, v: Verified) -> None:
        """A step's tested first nodes (:class:`~logitspec.spec_decode.budget.Verified`), all rows at once."""
        cells = v.states[v.first] * self.hits.shape[1] + v.kinds[v.first]
        self.tries += np.bincount(cells, minlength=self.tries.size).reshape(self.tries.shape)
        self.hits += np.bincount(cells, v.passed[v.first], minlength=self.hits.size).reshape(self.hits.shape)

    def bounds(self, state: int, kind: int) -> tuple[float, float]:
        return wilson(self.hits[state, kind], self.tries[state, kind])

    def unsound(self, tree: DraftTree, state: int, break_even: float,
                among: np.ndarray | None = None) -> bool:
        """Whether the evidence that ``tree``'s first nodes (those ``among`` marks, bool [nodes]: all
        without it) do not pay is not yet sound: some first node's kind has an acceptance interval
        reaching ``break_even``."""
        return any(self.bounds(state, int(tree.kinds[c]))[1] >= break_even for c in first_nodes(tree)
                   if among is None or among[c])

    def summary(self, kind_names: dict[int, str]) -> dict:
        """Per kind (states pooled): first nodes tested (decayed), acceptance and its interval."""
        out = {}
        for k, name in kind_names.items():
            h, t = float(self.hits[:, k].sum()), float(self.tries[:, k].sum())
            if t > 0:
                lo, hi = wilson(h, t)
                out[name] = {"tested": round(t, 1), "accepted": round(h / t, 3), "interval": [round(lo, 3),
                                                                                             round(hi, 3)]}
        return out


class _Arm:
    """Decayed mean and variance of per-step tokens per second for one mode."""

    def __init__(self, decay: float = ARM_DECAY):
        self.decay, self.w, self.w2, self.s, self.s2 = decay, 0.0, 0.0, 0.0, 0.0
        self.count = 0

    def add(self, x: float) -> None:
        d = self.decay
        self.w, self.w2 = d * self.w + 1.0, d * d * self.w2 + 1.0
        self.s, self.s2 = d * self.s + x, d * self.s2 + x * x
        self.count += 1

    @property
    def n(self) -> float:
        """Effective sample size."""
        return self.w * self.w / self.w2 if self.w2 else 0.0

    @property
    def mean(self) -> float:
        return self.s / self.w if self.w else 0.0

    @property
    def var(self) -> float:
        return max(self.s2 / self.w - self.mean ** 2, 0.0) if self.w else 0.0


class _ClassState:
    """The guard's state for one batch-size class."""

    def __init__(self):
        self.draft, self.plain = _Arm(), _Arm()
        self.verdict = "undecided"  # "draft" | "plain" | "undecided"
        self.every = RECHECK_FIRST  # steps between samples of the losing mode
        self.since = 0  # steps since the losing mode was last sampled
        self.shown: dict[str, float] = {}  # per mode, recent tokens per second (for the log)


class SpeedGuard:
    """Steps that may draft against plain steps, by measured tokens per second (see the module)."""

    def __init__(self):
        self._classes: dict[int, _ClassState] = {}

    def _of(self, rows: int) -> _ClassState:
        return self._classes.setdefault(size_class(rows), _ClassState())

    def mode(self, rows: int) -> str:
        """``"draft"`` (the budget decides) or ``"plain"`` for the next step of ``rows`` rows."""
        c = self._of(rows)
        if min(c.draft.n, c.plain.n) < MIN_ARM_STEPS:  # interleaved until both have a mean
            return "plain" if c.plain.count < c.draft.count else "draft"
        winner = "plain" if c.verdict == "plain" else "draft"
        c.since += 1
        if c.since >= c.every:
            c.since = 0
            return "draft" if winner == "plain" else "plain"
        return winner

    def record(self, rows: int, mode: str, tokens: int, seconds: float, plain_s: float | None = None) -> None:
        """A step of ``rows`` rows in ``mode`` committed ``tokens`` in ``seconds``. ``plain_s``: the
        cost curve's time for a plain step of ``rows`` rows; with it the modes are compared by tokens
        per row per plain step's time (steps of 4 and 7 rows share a class, and a step of more rows
        commits more tokens a second whatever its mode), without it by tokens per second."""
        if seconds <= 0:
            return
        c = self._of(rows)
        speed = tokens / rows * plain_s / seconds if plain_s else tokens / seconds
        (c.draft if mode == "draft" else c.plain).add(speed)
        c.shown[mode] = 0.9 * c.shown.get(mode, tokens / seconds) + 0.1 * tokens / seconds
        if min(c.draft.n, c.plain.n) < MIN_ARM_STEPS:
            return
        diff = c.draft.mean - c.plain.mean
        se = math.sqrt(c.draft.var / c.draft.n + c.plain.var / c.plain.n)
        verdict = "plain" if diff + Z * se < 0 else "draft" if diff - Z * se > 0 else "undecided"
        if verdict == "plain":  # drafting is re-checked often: at worst it costs a little
            c.every, c.since = RECHECK_DRAFT, c.since if c.verdict == "plain" else 0
        elif verdict == c.verdict and verdict != "undecided":
            c.every = min(2 * c.every, RECHECK_LAST) if mode != verdict else c.every
        elif verdict != c.verdict:
            c.every, c.since = RECHECK_FIRST, 0
        c.verdict = verdict

    def summary(self) -> dict:
        """Per batch-size class (keyed by its smallest row count): each mode's steps and tokens/s, the
        verdict."""
        out = {}
        for key, c in sorted(self._classes.items()):
            out[str(class_rows(key))] = {
                "verdict": c.verdict,
                "draft": {"steps": c.draft.count, "tokens_per_s": round(c.shown.get("draft", 0.0), 2)},
                "plain": {"steps": c.plain.count, "tokens_per_s": round(c.shown.get("plain", 0.0), 2)}}
        return out

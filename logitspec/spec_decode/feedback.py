"""The draft budget's estimates checked against what the steps deliver, and corrected.

The auto budget (:func:`~logitspec.spec_decode.budget.choose_sizes`) chooses nodes from estimates: acceptance
rates learned per node kind and a cost curve measured once. Both can be wrong in ways the budget
cannot see from inside: the product of per-kind rates along a path can overstate rows that are
not copying, and a curve measured on the model's own continuations leaves out the host's drafting
and verifying and the screen's work at rejected nodes. A wrong estimate makes
speculation slower than plain decoding, which it must never be.

:class:`Realised` keeps two running ratios over recent steps and hands them to the budget:

- ``tokens``: drafted tokens accepted / the kept nodes' estimated probabilities, over drafting steps;
- ``cost``: a drafting step's measured time / the curve's time for it, over the same ratio of plain
  steps (their running mean when the drafting step ran), so a drafting step is priced by what
  drafting steps have cost relative to plain ones here, drafting and verifying on the host included.
  Without drafting steps it stays 1, however far plain steps are from the curve.

Each is an exponentially weighted mean (``decay`` per step) that starts at 1 with the weight of
``prior`` steps, and is kept within ``[1 / LIMIT, LIMIT]``; they are kept apart per batch-size class
(2-3, 4-7, 8-15, ... rows: what a node costs against a step differs with the rows). One row gets
none (below ``MIN_ROWS``): its curve is measured on the kind of step it takes, and there the
corrections only added noise (MAT 1.85-2.45 with them, 2.39-2.43 without, in an A/B run since
removed: ``git show 4974864:scripts/feedback_ab.py``). Steps that verified no drafts update the
plain side; nothing else does, so a budget that stops drafting keeps its last corrections until its
probes (:mod:`logitspec.spec_decode.evidence`) bring new ones.
"""
from __future__ import annotations

LIMIT = 4.0  # the corrections stay within [1 / LIMIT, LIMIT]
MIN_ROWS = 2  # steps of fewer rows get no corrections


class _Mean:
    """An exponentially weighted mean, starting at 1 with the weight of ``prior`` samples."""

    def __init__(self, prior: float, decay: float):
        self.decay, self.total, self.weight = decay, prior, prior

    def add(self, value: float) -> None:
        self.total = self.decay * self.total + value
        self.weight = self.decay * self.weight + 1.0

    @property
    def value(self) -> float:
        return self.total / self.weight


def size_class(rows: int) -> int:
    """The batch-size class of a step of ``rows`` rows: 1 | 2-3 | 4-7 | 8-15 | ... (its key)."""
    return int(rows).bit_length()


def class_rows(key: int) -> int:
    """The smallest row count of batch-size class ``key``."""
    return 1 << (key - 1)


class Realised:
    """Corrections for the budget's token and cost estimates from the steps so far, per batch-size
    class (see the module): ``of(rows)`` gives the class's :class:`Corrections`."""

    def __init__(self, prior: float = 8.0, decay: float = 0.95):
        self.prior, self.decay = prior, decay
        self._classes: dict[int, Corrections] = {}
        self._none = _Neutral()

    def of(self, rows: int) -> "Corrections":
        """The corrections for steps of ``rows`` rows (created at the prior on first use; neutral,
        learning nothing, below ``MIN_ROWS``)."""
        if rows < MIN_ROWS:
            return self._none
        key = size_class(rows)
        if key not in self._classes:
            self._classes[key] = Corrections(self.prior, self.decay)
        return self._classes[key]

    def as_dict(self) -> dict[str, float]:
        """Each class's corrections, keyed by its smallest row count."""
        out = {}
        for key, c in sorted(self._classes.items()):
            rows = class_rows(key)
            out[f"budget_token_scale@{rows}"], out[f"budget_cost_scale@{rows}"] = c.tokens, c.cost
        return out


class Corrections:
    """The two corrections of one batch-size class."""

    def __init__(self, prior: float, decay: float):
        self._tokens_real = _Mean(prior, decay)  # per drafting step: drafted tokens accepted
        self._tokens_expected = _Mean(prior, decay)  # ... and expected
        # per drafting step: (measured / curve seconds) / plain steps' mean
        self._draft_time = _Mean(prior, decay)
        self._plain_time = _Mean(prior, decay)  # per plain step: measured / curve seconds

    def update(self, expected_tokens: float, accepted_tokens: int, curve_s: float, measured_s: float) -> None:
        """One step: the budget expected ``expected_tokens`` drafted tokens accepted (0 when it
        verified none) in ``curve_s`` seconds; the step accepted ``accepted_tokens`` and took
        ``measured_s``."""
        if curve_s <= 0 or measured_s <= 0:
            return
        ratio = min(max(measured_s / curve_s, 1 / LIMIT ** 2), LIMIT ** 2)  # one outlier step moves it little
        if expected_tokens > 0:
            # sums of tokens, not a mean of per-step ratios: a step that expected little weighs little
            self._tokens_real.add(accepted_tokens)
            self._tokens_expected.add(expected_tokens)
            self._draft_time.add(ratio / self._plain_time.value)
        else:
            self._plain_time.add(ratio)

    @property
    def tokens(self) -> float:
        """Multiply the expected accepted tokens by this."""
        return _clip(self._tokens_real.value / self._tokens_expected.value)

    @property
    def cost(self) -> float:
        """Multiply a drafting forward's curve time (against a plain one's) by this."""
        return _clip(self._draft_time.value)


class _Neutral(Corrections):
    """No corrections, and nothing learned."""

    def __init__(self):
        super().__init__(1.0, 1.0)

    def update(self, expected_tokens: float, accepted_tokens: int, curve_s: float, measured_s: float) -> None:
        pass


def _clip(x: float) -> float:
    return min(max(x, 1 / LIMIT), LIMIT)

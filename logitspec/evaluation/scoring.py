"""Dataset scores as LongBench v1's ``eval.py`` computes them.

Per row: for trec, triviaqa, samsum and lsht only the prediction's first line counts; the row's score
is the best metric value over its reference answers. Per dataset: ``round(100 * mean, 2)``; for
LongBench-E the same per length bucket (``0-4k``, ``4-8k``, ``8k+`` of the row's ``length``).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import numpy as np

from .longbench import Example
from .metrics import METRICS
from .prompts import dataset_spec

__all__ = [
    "LENGTH_BUCKETS",
    "metric_for",
    "length_bucket",
    "score_prediction",
    "score_dataset",
    "score_dataset_by_length",
    "score_examples",
    "score_examples_by_length",
]

LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")


def metric_for(name: str) -> Callable[..., float]:
    """The metric function of a dataset (``qasper`` and ``qasper_e`` alike)."""
    return METRICS[dataset_spec(name).metric]


def length_bucket(length: int) -> str:
    """LongBench-E's bucket of a row's ``length``: below 4000, below 8000, or more."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def score_prediction(
    name: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """One row's score in [0, 1]: the dataset's metric, maximised over ``answers``."""
    spec = dataset_spec(name)
    metric = METRICS[spec.metric]
    if spec.first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    score = 0.0
    for truth in answers:
        score = max(score, metric(prediction, truth, all_classes=all_classes))
    return score


def _row_scores(name, predictions, answers, classes_per_row) -> list[float]:
    predictions, answers, classes_per_row = list(predictions), list(answers), list(classes_per_row)
    if not (len(predictions) == len(answers) == len(classes_per_row)):
        raise ValueError(
            f"{name}: {len(predictions)} predictions for {len(answers)} answer lists "
            f"and {len(classes_per_row)} class lists"
        )
    return [score_prediction(name, p, a, c) for p, a, c in zip(predictions, answers, classes_per_row)]


def _percent(scores: list[float]) -> float:
    # eval.py's scorer adds the row scores one by one (``total_score += score``). Not ``sum()``: from
    # Python 3.12 ``sum`` of floats is compensated and can round the last digit the other way
    # ([0.2, 0.125, 0.4, 0.3]: 25.63 by the loop, 25.62 by 3.12's sum).
    total = 0.0
    for score in scores:
        total += score
    return round(100 * total / len(scores), 2)


def _bucket_percent(scores: list[float]) -> float:
    # eval.py's scorer_e rounds a numpy mean (numpy's rounding); NaN for an empty bucket, as np.mean gives
    return float(round(100 * np.mean(scores), 2)) if scores else math.nan


def score_dataset(
    name: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """``round(100 * mean row score, 2)`` with one ``all_classes`` for the dataset (as ``eval.py``)."""
    if not predictions:
        raise ValueError(f"{name}: no predictions to score")
    return _percent(_row_scores(name, predictions, answers, [all_classes] * len(predictions)))


def _bucketed(name, predictions, answers, lengths, classes_per_row) -> dict[str, float]:
    lengths = list(lengths)
    scores = _row_scores(name, predictions, answers, classes_per_row)
    if len(lengths) != len(scores):
        raise ValueError(f"{name}: {len(scores)} predictions for {len(lengths)} lengths")
    buckets: dict[str, list[float]] = {b: [] for b in LENGTH_BUCKETS}
    for score, length in zip(scores, lengths):
        buckets[length_bucket(length)].append(score)
    return {b: _bucket_percent(s) for b, s in buckets.items()}


def score_dataset_by_length(
    name: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes: Sequence[str] | None = None,
) -> dict[str, float]:
    """LongBench-E's ``{bucket: round(100 * mean, 2)}``; NaN for a bucket without rows."""
    return _bucketed(name, predictions, answers, lengths, [all_classes] * len(predictions))


def _pairs(examples: Iterable[Example], predictions: Sequence[str]) -> tuple[list[Example], list[str]]:
    examples, predictions = list(examples), list(predictions)
    if len(examples) != len(predictions):
        raise ValueError(f"{len(examples)} examples but {len(predictions)} predictions")
    if not examples:
        raise ValueError("no examples to score")
    names = {e.name for e in examples}
    if len(names) != 1:
        raise ValueError(f"examples of several datasets at once: {sorted(names)}")
    return examples, predictions


def score_examples(examples: Iterable[Example], predictions: Sequence[str]) -> float:
    """:func:`score_dataset` for rows of one dataset, each scored with its own ``all_classes``.

    (LongBench passes the last row's classes to every row; its files give all rows the same list.)
    """
    examples, predictions = _pairs(examples, predictions)
    answers = [e.answers for e in examples]
    return _percent(_row_scores(examples[0].name, predictions, answers, [e.all_classes for e in examples]))


def score_examples_by_length(examples: Iterable[Example], predictions: Sequence[str]) -> dict[str, float]:
    """:func:`score_dataset_by_length` for rows of one dataset, bucketed by their ``length``."""
    examples, predictions = _pairs(examples, predictions)
    return _bucketed(
        examples[0].name,
        predictions,
        [e.answers for e in examples],
        [e.length for e in examples],
        [e.all_classes for e in examples],
    )

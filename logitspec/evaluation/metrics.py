"""LongBench v1's per-answer metrics, re-implemented to give the numbers of its ``metrics.py``.

Each metric takes ``(prediction, ground_truth, **kwargs)`` and returns a float in [0, 1]; the
dataset-level rules (first line, max over answers, averaging) live in :mod:`.scoring`.
Behaviour kept on purpose, because LongBench's published scores include it:

* ``classification_score`` never reaches its similarity fallback (LongBench tests a list against 0),
  and when it drops a class name contained in the ground truth it skips checking the next one
  (it removes from the list it is iterating over).
* ``code_sim_score`` is fuzzywuzzy's ``fuzz.ratio`` as LongBench v1 installs it (fuzzywuzzy without
  python-Levenshtein, i.e. :class:`difflib.SequenceMatcher`), an int in 0..100, divided by 100.
* ``rouge_score`` is the ``rouge`` package's ROUGE-L F (sentences split at ``.``, unique words
  counted), 0.0 where it raises (for example an empty prediction).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Callable, Sequence

__all__ = [
    "normalize_answer",
    "normalize_zh_answer",
    "token_f1",
    "qa_f1_score",
    "qa_f1_zh_score",
    "rouge_score",
    "rouge_zh_score",
    "classification_score",
    "retrieval_score",
    "retrieval_zh_score",
    "count_score",
    "fuzz_ratio",
    "first_code_line",
    "code_sim_score",
    "METRICS",
]

_EN_PUNCTUATION = frozenset(string.punctuation)
# LongBench's Chinese punctuation list (full-width forms, CJK brackets, dashes, quotes, ellipsis, '.')
_CN_PUNCTUATION = ("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃"
                   "》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")
_ZH_PUNCTUATION = _EN_PUNCTUATION | frozenset(_CN_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")


def normalize_answer(text: str) -> str:
    """Lower-case, drop ASCII punctuation, then the articles a/an/the, then collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
    """Lower-case, drop ASCII and Chinese punctuation and all whitespace."""
    return "".join(ch for ch in text.lower() if ch not in _ZH_PUNCTUATION and not ch.isspace())


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Bag-of-tokens F1: overlap counted with multiplicity; 0.0 without overlap."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction)
    recall = same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 of the normalized (:func:`normalize_answer`) whitespace tokens."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _jieba_words(text: str) -> list[str]:
    import jieba  # imported on first use: loading its dictionary takes about a second

    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 of jieba words, each normalized by :func:`normalize_zh_answer`, empty ones dropped."""

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in _jieba_words(text)) if w]

    return token_f1(words(prediction), words(ground_truth))


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F of the ``rouge`` package (as LongBench calls it); 0.0 where the package raises."""
    from rouge import Rouge

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # LongBench: a bare except (empty hypothesis, nothing but dots, ...)
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """:func:`rouge_score` over jieba words joined by spaces."""
    return rouge_score(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(ground_truth)))


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """1/k when the ground truth is among the k class names found in the prediction, else 0.0.

    Needs ``all_classes``. A found name that is part of the ground truth but not equal to it is
    dropped (``"Person"`` when the truth is ``"Person name"``), with LongBench's skip of the next name.
    """
    all_classes = kwargs["all_classes"]
    if all_classes is None:
        raise ValueError("classification_score needs all_classes (the row's 'all_classes')")
    found = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(found):
        name = found[i]
        if name in ground_truth and name != ground_truth:
            found.remove(name)  # the entry that moves into slot i is then not checked, as in LongBench
        i += 1
    return 1.0 / len(found) if ground_truth in found else 0.0


def _number_share(prediction: str, target: str) -> float:
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == target) / len(numbers)


def _paragraph_id(ground_truth: str, pattern: str) -> str:
    match = re.search(pattern, ground_truth)
    if match is None:
        raise ValueError(f"ground truth {ground_truth!r} has no paragraph number ({pattern})")
    return match.group(1)


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Share of the numbers in the prediction equal to k of the ground truth ``Paragraph k``."""
    return _number_share(prediction, _paragraph_id(ground_truth, r"Paragraph (\d+)"))


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Share of the numbers in the prediction equal to k of the ground truth ``段落k``."""
    return _number_share(prediction, _paragraph_id(ground_truth, r"段落(\d+)"))


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Share of the numbers in the prediction equal to the ground truth."""
    return _number_share(prediction, str(ground_truth))


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` (pure-Python build): 100 for equal strings, 0 if one is empty,
    else ``round(100 * SequenceMatcher(None, a, b).ratio())`` (Python's round: halves to even)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def first_code_line(prediction: str) -> str:
    """The first line (after leading newlines) with no backtick, ``#`` or ``//``; "" if none."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """:func:`fuzz_ratio` of :func:`first_code_line` and the ground truth, over 100."""
    return fuzz_ratio(first_code_line(prediction), ground_truth) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1_score": qa_f1_score,
    "qa_f1_zh_score": qa_f1_zh_score,
    "rouge_score": rouge_score,
    "rouge_zh_score": rouge_zh_score,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "retrieval_zh_score": retrieval_zh_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
}

"""LongBench v1 data format: one JSON-lines file per dataset, one :class:`Example` per line.

A LongBench ``data/`` directory holds ``<dataset>.jsonl`` files (``narrativeqa.jsonl``, ...) and, for
LongBench-E, ``<dataset>_e.jsonl`` files. Each line is an object with the keys ``input``, ``context``,
``answers``, ``all_classes``, ``length``, ``dataset``, ``language`` and ``_id``; keys beyond those are
kept in :attr:`Example.extra`. Known dataset names come from ``longbench_config.json``
(:func:`logitspec.evaluation.prompts.resolve_name`).
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .longbench_v2 import is_v2_name, read_v2
from .prompts import resolve_name

__all__ = [
    "Example",
    "LongBenchFormatError",
    "REQUIRED_KEYS",
    "list_datasets",
    "read_dataset",
    "read_directory",
    "example_from_json",
    "example_to_json",
    "write_dataset",
]

REQUIRED_KEYS = ("input", "context", "answers", "all_classes", "length", "dataset", "language", "_id")


class LongBenchFormatError(ValueError):
    """A LongBench directory, file or line is missing or malformed; the message says where."""


@dataclass(frozen=True)
class Example:
    """One LongBench row. ``name`` is the file's dataset name (``qasper`` or ``qasper_e``)."""

    name: str
    input: str
    context: str
    answers: tuple[str, ...]
    all_classes: tuple[str, ...] | None
    length: int
    dataset: str
    language: str
    id: str
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def base(self) -> str:
        """The LongBench dataset whose template and metric apply (``qasper`` for ``qasper_e``)."""
        return resolve_name(self.name)[0]


def _directory(directory: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(directory).expanduser()
    if not path.is_dir():
        raise LongBenchFormatError(
            f"LongBench data directory {str(path)!r} does not exist or is not a directory"
        )
    return path


def list_datasets(directory: str | os.PathLike) -> list[str]:
    """Sorted dataset names of the ``*.jsonl`` files in ``directory`` whose names are known, and of
    LongBench v2 files (``longbench_v2*.json`` or ``.jsonl``, :mod:`.longbench_v2`)."""
    path = _directory(directory)
    names = set()
    for f in sorted(path.glob("*.jsonl")):
        try:
            resolve_name(f.stem)
        except ValueError:
            if not is_v2_name(f.stem):
                continue
        names.add(f.stem)
    names.update(f.stem for f in path.glob("*.json") if is_v2_name(f.stem))
    return sorted(names)


def _v2_file(path: pathlib.Path, name: str) -> pathlib.Path:
    files = [f for f in (path / f"{name}.jsonl", path / f"{name}.json") if f.is_file()]
    if not files:
        raise LongBenchFormatError(f"no file {str(path / name)!r}.jsonl or .json for dataset {name!r}")
    if len(files) > 1:
        raise LongBenchFormatError(f"both {files[0].name} and {files[1].name} in {str(path)!r}: keep one")
    return files[0]


def _str_tuple(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key!r} must be a list of strings, got {value!r:.80}")
    return tuple(value)


def example_from_json(obj: Any, name: str) -> Example:
    """Check one decoded line against the LongBench v1 schema and build its Example (ValueError if not)."""
    if not isinstance(obj, dict):
        raise ValueError(f"a line must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        raise ValueError(f"missing keys {missing}")
    for key in ("input", "context", "dataset", "language", "_id"):
        if not isinstance(obj[key], str):
            raise ValueError(f"{key!r} must be a string, got {obj[key]!r:.80}")
    answers = _str_tuple(obj["answers"], "answers")
    if not answers:
        raise ValueError("'answers' is empty")
    classes = None if obj["all_classes"] is None else _str_tuple(obj["all_classes"], "all_classes")
    length = obj["length"]
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"'length' must be a non-negative integer, got {length!r}")
    return Example(
        name=name,
        input=obj["input"],
        context=obj["context"],
        answers=answers,
        all_classes=classes,
        length=length,
        dataset=obj["dataset"],
        language=obj["language"],
        id=obj["_id"],
        extra={k: v for k, v in obj.items() if k not in REQUIRED_KEYS},
    )


def read_dataset(directory: str | os.PathLike, name: str) -> list[Example]:
    """All rows of ``<directory>/<name>.jsonl`` (blank lines skipped), in file order; for a LongBench
    v2 name the :class:`~.longbench_v2.ExampleV2` rows of its ``.jsonl`` or ``.json`` file."""
    if is_v2_name(name):
        try:
            return read_v2(_v2_file(_directory(directory), name), name)
        except LongBenchFormatError:
            raise
        except ValueError as e:  # read_v2's messages name the file and line
            raise LongBenchFormatError(str(e)) from e
    resolve_name(name)  # UnknownDatasetError (a ValueError) for a name no config knows
    path = _directory(directory) / f"{name}.jsonl"
    if not path.is_file():
        raise LongBenchFormatError(f"no file {str(path)!r} for dataset {name!r}")
    examples = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                examples.append(example_from_json(json.loads(line), name))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise LongBenchFormatError(f"{path}:{number}: {e}") from e
    return examples


def read_directory(
    directory: str | os.PathLike, names: Iterable[str] | None = None
) -> dict[str, list[Example]]:
    """``{name: rows}`` for ``names`` (default: every known dataset file in ``directory``)."""
    chosen = list_datasets(directory) if names is None else list(names)
    if not chosen:
        raise LongBenchFormatError(f"no LongBench dataset files (<dataset>.jsonl, longbench_v2.json) in "
                                   f"{str(directory)!r}")
    return {name: read_dataset(directory, name) for name in chosen}


def example_to_json(example: Example) -> dict[str, Any]:
    """The JSON object of one row, LongBench's keys first, then :attr:`Example.extra`."""
    obj: dict[str, Any] = {
        "input": example.input,
        "context": example.context,
        "answers": list(example.answers),
        "length": example.length,
        "dataset": example.dataset,
        "language": example.language,
        "all_classes": None if example.all_classes is None else list(example.all_classes),
        "_id": example.id,
    }
    obj.update(example.extra)
    return obj


def write_dataset(directory: str | os.PathLike, name: str, examples: Iterable[Example]) -> pathlib.Path:
    """Write ``<directory>/<name>.jsonl`` (UTF-8, one object a line, non-ASCII kept); return its path."""
    resolve_name(name)  # UnknownDatasetError (a ValueError) for a name no config knows
    path = pathlib.Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    out = path / f"{name}.jsonl"
    with out.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example_to_json(example), ensure_ascii=False) + "\n")
    return out

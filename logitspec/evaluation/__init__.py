"""LongBench-style evaluation: the data format, prompts, metrics and a local data generator (no Ray)."""

from .longbench import (
    Example,
    LongBenchFormatError,
    list_datasets,
    read_dataset,
    read_directory,
    write_dataset,
)
from .prompts import (
    DatasetSpec,
    UnknownDatasetError,
    build_prompt,
    dataset_names,
    dataset_spec,
    format_prompt,
    truncate_middle,
)
from .scoring import (
    score_dataset,
    score_dataset_by_length,
    score_examples,
    score_examples_by_length,
    score_prediction,
)

__all__ = [
    "Example",
    "LongBenchFormatError",
    "list_datasets",
    "read_dataset",
    "read_directory",
    "write_dataset",
    "DatasetSpec",
    "UnknownDatasetError",
    "build_prompt",
    "dataset_names",
    "dataset_spec",
    "format_prompt",
    "truncate_middle",
    "score_dataset",
    "score_dataset_by_length",
    "score_examples",
    "score_examples_by_length",
    "score_prediction",
]

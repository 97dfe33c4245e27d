"""LongBench-style evaluation: the data format, prompts, metrics and a local data generator (no Ray);
LongBench v1 (with LongBench-E) and LongBench v2 (multiple choice)."""

from .longbench import (
    Example,
    LongBenchFormatError,
    list_datasets,
    read_dataset,
    read_directory,
    write_dataset,
)
from .longbench_v2 import ExampleV2, extract_answer, read_v2, score_v2
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
    "ExampleV2",
    "extract_answer",
    "read_v2",
    "score_v2",
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

"""Benchmarking: ``logitspec bench`` (Spec-Bench tables), ``logitspec throughput`` (tokens/s by batch
size) and ``logitspec calibrate`` (the forward cost curve's command line).

Modules: :mod:`.questions` (the Spec-Bench loader, tasks, prompts, the warm-up question),
:mod:`.methods` (method names, variants and runners), :mod:`.run` (the side-by-side run),
:mod:`.results` (the output directory), :mod:`.report` (numbers, report and plots from the records),
:mod:`.provenance` (machine and code version), :mod:`.cli`, :mod:`.throughput`, :mod:`.calibrate_cli`.
"""
from .methods import DEFAULT_METHODS, REFERENCE, MethodSpec, parse_methods
from .questions import DEFAULT_QUESTIONS, PromptBuilder, Question, load_questions, select_questions
from .results import rerender, write_outputs
from .run import bench, run_bench

__all__ = ["DEFAULT_METHODS", "DEFAULT_QUESTIONS", "REFERENCE", "MethodSpec", "PromptBuilder", "Question",
           "bench",
           "load_questions", "parse_methods", "rerender", "run_bench", "select_questions", "write_outputs"]

"""Ray batch generation on top of :mod:`logitspec`: read and shard datasets, run model replicas, write
results.

Sub-packages, by role:

- :mod:`pipeline.job`: the generation job (flags, config, plan, run, progress, summary);
- :mod:`pipeline.sweep`: the evaluation sweep (a grid of engine configurations over LongBench-format data);
- :mod:`pipeline.replica`: model replicas on Ray (actors, tensor-parallel groups, the worker that turns
  rows into generations, the scheduler that feeds replicas and survives their deaths);
- :mod:`pipeline.io`: input tables, the output directory, reference indexes, the model check.

:mod:`pipeline.rows` holds the typed rows that travel between them and their Arrow schemas.
Entry points: ``logitspec job|eval|build-index`` (and ``jobs/*.py`` for ``ray job submit``); in Python,
:func:`run_job`.
"""
from .errors import ConfigError
from .job.config import JobConfig
from .spec import GenerationSpec

__all__ = ["ConfigError", "GenerationSpec", "JobConfig", "run_job"]


def run_job(cfg: JobConfig, **kwargs):
    """Run a job; see :func:`pipeline.job.run.run_job`."""
    from .job.run import run_job as run

    return run(cfg, **kwargs)

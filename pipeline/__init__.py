"""Ray batch generation on top of :mod:`logitspec`: read and shard datasets, run model replicas, write results.

Entry point: ``python jobs/generate.py`` (:func:`pipeline.cli.main`); in Python, :func:`run_job`.
"""
from .config import ConfigError, GenerationSpec, JobConfig

__all__ = ["ConfigError", "GenerationSpec", "JobConfig", "run_job"]


def run_job(cfg: JobConfig, **kwargs):
    """Run a job; see :func:`pipeline.job.run_job`."""
    from .job import run_job as _run

    return _run(cfg, **kwargs)

"""The batch-generation job: flags -> :class:`~pipeline.job.config.JobConfig` -> plan (no Ray) -> run
(replicas on Ray) -> Parquet rows and ``_summary.json``."""

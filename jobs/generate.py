"""Batch generation job: Arrow/Parquet/JSONL/CSV prompts in, Parquet generations + acceptance stats out.

    python jobs/generate.py --input data/sample_prompts.jsonl --output out/sample
    ray job submit --working-dir . -- python jobs/generate.py --input ... --output ...

See docs/pipeline.md and ``--help``.
"""
import pathlib
import sys

# Runs from a plain checkout too (e.g. a `ray job submit --working-dir .` upload): the repo root is
# importable.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from pipeline.job.cli import main

if __name__ == "__main__":
    sys.exit(main())

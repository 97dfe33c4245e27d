"""Evaluation sweep over a LongBench-format directory: methods x engine settings, scored, one report.

    python jobs/eval.py --data data/longbench_local --model default --methods ar,logitspec --output out/eval
    ray job submit --working-dir . -- python jobs/eval.py --data ... --methods ar,pld,logitspec --output ...

See docs/evaluation.md and ``--help``.
"""
import pathlib
import sys

# Runs from a plain checkout too (e.g. a `ray job submit --working-dir .` upload): the repo root is
# importable.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from pipeline.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())

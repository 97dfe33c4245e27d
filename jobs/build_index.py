"""Prebuild a reference corpus's n-gram index to disk, for ``jobs/generate.py --reference NAME=FILE.npz``.

    python jobs/build_index.py --corpus data/sample_corpus/licenses --output indexes/licenses.npz
    logitspec build-index --corpus ... --output ...     (the same command)

See :mod:`pipeline.io.build_index` and ``--help``.
"""
import pathlib
import sys

# Runs from a plain checkout too (e.g. a `ray job submit --working-dir .` upload): the repo root is
# importable.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from pipeline.io.build_index import main

if __name__ == "__main__":
    sys.exit(main())

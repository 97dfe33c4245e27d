"""Command line of ``logitspec build-index`` (and ``jobs/build_index.py``): prebuild a reference corpus's
n-gram index to disk, for the job's ``--reference NAME=FILE.npz``.

The corpus is tokenized with the model's tokenizer (``--model``, as in the job); the index file records
that tokenizer's fingerprint and the job refuses an index built with another one.
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

from logitspec.helpfmt import DefaultsHelpFormatter

from ..errors import ConfigError

DESCRIPTION = "Prebuild a reference corpus's n-gram index (.npz) for the job's --reference NAME=FILE.npz."


def build_parser(prog: str = "jobs/build_index.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--corpus", required=True, metavar="PATH[#COLUMN]",
                   help="text file, directory, or table/dataset column (default column: text)")
    p.add_argument("--output", required=True, help="index file to write (.npz)")
    p.add_argument("--model", default="default", help="whose tokenizer to use (as --model of the job)")
    p.add_argument("--max-ngram", type=int, default=3,
                   help="longest n-gram indexed (the engine's SpecConfig.max_ngram: a draft continues the "
                        "longest match of up to this many context tokens)")
    return p


def main(argv=None, prog: str = "jobs/build_index.py") -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .model import check_model
    from .reference import prepare_reference, save_index, split_meta

    try:
        if not args.output.endswith(".npz"):
            raise ConfigError(f"--output must end in .npz, got {args.output!r}")
        if args.max_ngram < 1:
            raise ConfigError(f"--max-ngram must be >= 1, got {args.max_ngram}")
        from transformers import AutoTokenizer

        path = check_model(args.model)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        arrays = prepare_reference(pathlib.Path(args.output).stem, args.corpus, tokenizer, args.max_ngram)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save_index(args.output, arrays)
    _, meta = split_meta(arrays)
    print(json.dumps({"output": args.output, **meta}, indent=2))
    return 0

"""Prebuild a reference corpus's n-gram index to disk, for ``jobs/generate.py --reference NAME=FILE.npz``.

    python jobs/build_index.py --corpus data/sample_corpus/licenses --output indexes/licenses.npz

The corpus is tokenized with the model's tokenizer (``--model``, as in the job); the index file records
that tokenizer's fingerprint and the job refuses an index built with another one.
"""
import argparse
import json
import logging
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from pipeline.config import ConfigError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", required=True, metavar="PATH[#COLUMN]",
                   help="text file, directory, or table/dataset column (default column: text)")
    p.add_argument("--output", required=True, help="index file to write (.npz)")
    p.add_argument("--model", default="default", help="whose tokenizer to use (as --model of the job)")
    p.add_argument("--max-ngram", type=int, default=3)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from pipeline.plan import check_model
    from pipeline.reference import prepare_reference, save_index, split_meta

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


if __name__ == "__main__":
    sys.exit(main())

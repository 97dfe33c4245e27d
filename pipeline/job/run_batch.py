"""``logitspec run-batch -i requests.jsonl -o results.jsonl``: an OpenAI batch file through the job, as
``vllm run-batch`` runs one. The job's Parquet dataset (the source of truth, what a rerun resumes from)
goes to ``<results>.d/`` unless ``--output-dir`` says where; every other flag is the job's."""
from __future__ import annotations

import argparse

from .cli import main as job_main


def main(argv=None, prog: str = "logitspec run-batch") -> int:
    p = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Run an OpenAI batch file (JSONL of {custom_id, method, url, body}) through the job and "
        "write the OpenAI batch results file. A rerun of the same command resumes.",
        epilog="Every other flag is the job's (logitspec job --help): --model, --method, --actors, ...")
    p.add_argument("-i", "--input-file", required=True, help="the OpenAI batch requests (JSONL)")
    p.add_argument("-o", "--output-file", required=True, help="the OpenAI batch results file to write")
    p.add_argument("--output-dir", default=None,
                   help="the job's Parquet dataset and records (default: <output-file>.d)")
    args, rest = p.parse_known_args(argv)
    return job_main(["--input", args.input_file, "--output", args.output_dir or f"{args.output_file}.d",
                     "--input-format", "openai", "--output-format", "openai", "--results", args.output_file,
                     *rest], prog=prog)

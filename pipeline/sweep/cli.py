"""Command line of ``logitspec eval`` and ``jobs/eval.py``: flags -> :class:`EvalConfig` ->
:func:`run_sweep` -> the report.

Exit codes: 0 done, 2 the sweep could not start (bad flag, data, model or output; nothing ran), 1 it
started but could not finish (rerun to resume), 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from logitspec.config import METHODS
from logitspec.helpfmt import DefaultsHelpFormatter

from ..errors import ConfigError
from ..spec import DTYPES
from .config import GRID_KEYS, EvalConfig

DESCRIPTION = ("LongBench-format evaluation sweep: every method x engine setting on every row, on Ray; "
               "scores, speeds and speed-ups against ar in OUTPUT/report.{json,md,png}.")


def build_parser(prog: str = "jobs/eval.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, formatter_class=DefaultsHelpFormatter,
                                description=DESCRIPTION)
    p.add_argument("--data", required=True,
                   help="LongBench-format directory (one <dataset>.jsonl per dataset)")
    p.add_argument("--output", required=True, help="sweep directory: rows/ (Parquet, resumable) and report.*")
    p.add_argument("--datasets", default="",
                   help="comma-separated dataset names (default: every file in --data)")
    p.add_argument("--limit", type=int, default=None, help="only the first N rows of each dataset")
    p.add_argument("--model", default="default",
                   help="'default', a HF model dir, a .gguf file or a cached HF id")
    p.add_argument("--methods", default="ar,logitspec",
                   help=f"comma-separated methods ({', '.join(METHODS)}); 'ar' is the speed-up baseline")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help=f"engine settings to sweep (repeatable), KEY one of {', '.join(GRID_KEYS)}; a "
                        "setting applies only to the methods that use it")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on each dataset's own maximum new tokens (LongBench's dataset2maxlen)")
    p.add_argument("--max-length", type=int, default=None,
                   help="prompt tokens kept by the middle truncation (default: context - new tokens - 64)")
    p.add_argument("--chat", default="auto", choices=("auto", "never"),
                   help="auto: the chat template for the datasets LongBench prompts as chat, if the "
                        "tokenizer has one")
    p.add_argument("--max-batch-size", type=int, default=1,
                   help="engine batch (unless --grid max_batch_size=...)")
    p.add_argument("--prefix-cache-gb", type=float, default=4.0,
                   help="KV of prefilled rows kept per replica, shared by the configurations' engines, so a "
                        "row is prefilled once for the whole grid (0: every configuration prefills)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--no-warmup", action="store_true", help="skip each engine's warm-up generation")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run the model's own code")
    p.add_argument("--overwrite", action="store_true", help="start over instead of resuming")
    p.add_argument("--address", default=None, help="Ray cluster (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument("--actors", type=int, default=1, help="model replicas (one actor each)")
    p.add_argument("--cpus-per-actor", type=float, default=None,
                   help="default: the local Ray's CPUs / actors")
    p.add_argument("--threads-per-actor", type=int, default=None,
                   help="torch threads; default: the actor's CPUs")
    p.add_argument("--batch-rows", type=int, default=None,
                   help="rows per actor task (each runs every configuration); default 2 x the largest batch")
    p.add_argument("--max-replacements", type=int, default=None, help="dead actors replaced before giving up")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    return p


def split(text: str) -> tuple[str, ...]:
    """``"a, b,,c"`` -> ``("a", "b", "c")``."""
    return tuple(s.strip() for s in text.split(",") if s.strip())


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    return EvalConfig(
        data=args.data, output=args.output, model=args.model, methods=split(args.methods),
        grid=tuple(args.grid),
        datasets=split(args.datasets), limit=args.limit, max_new_tokens=args.max_new_tokens,
        max_length=args.max_length, chat=args.chat, max_batch_size=args.max_batch_size, dtype=args.dtype,
        prefix_cache_gb=args.prefix_cache_gb,
        warmup=not args.no_warmup, trust_remote_code=args.trust_remote_code, actors=args.actors,
        cpus_per_actor=args.cpus_per_actor, threads_per_actor=args.threads_per_actor,
        batch_rows=args.batch_rows,
        overwrite=args.overwrite, address=args.address, log_interval=args.log_interval,
        max_replacements=args.max_replacements)


def main(argv=None, prog: str = "jobs/eval.py") -> int:
    """``jobs/eval.py`` and ``logitspec eval`` (``prog``: the name its help and errors give)."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    from ..replica.scheduler import JobFailed
    from .run import run_sweep

    try:
        report = run_sweep(config_from_args(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (JobFailed, OSError) as e:
        print(f"error: the sweep did not finish: {e}; rerun to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"interrupted ({e or 'KeyboardInterrupt'}); rerun the same command to resume", file=sys.stderr)
        return 130
    brief = {"overall": report["overall"], "lossless": {k: v for k, v in report["lossless"].items()
                                                        if k != "mismatches"}, "output": args.output}
    print(json.dumps(brief, indent=2, default=str))
    return 0

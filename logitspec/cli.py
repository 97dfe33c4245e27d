"""``logitspec``: one command for everything a user runs.

The engine's commands (``generate``, ``bench``, ``calibrate``, ``throughput``) and the Ray pipeline's
(``job``, ``eval``, ``build-index``: the programs of ``jobs/*.py``, same flags). The pipeline's are
imported only when run, so this package still imports nothing of Ray or of :mod:`pipeline`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from . import allocator
from .config import METHODS, SpecConfig
from .request import Request


def _add_generate(sub) -> None:
    text = "generate a continuation for one or more prompts"
    p = sub.add_parser("generate", help=text, description=f"Generate: {text}, with the engine in this process.")
    p.add_argument("prompts", nargs="+", help="prompt text(s)")
    p.add_argument("--model", default="default", help="'default', a HF model dir, a .gguf file or a cached HF id")
    p.add_argument("--method", default="logitspec", choices=METHODS)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--max-batch-size", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print token ids, text and stats as JSON")
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    config = SpecConfig(method=args.method, max_batch_size=args.max_batch_size)  # validates first
    from .engine import Engine
    from .models import load_model

    model, tok = load_model(args.model)
    engine = Engine(model, tok, config)
    request = Request(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    results = engine.generate(args.prompts, request, apply_chat_template=args.chat)
    for r in results:
        if args.json:
            print(json.dumps({"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                              "stats": r.stats}))
        else:
            print(r.text)
    return 0


# the pipeline's programs (Ray): their flags live with them, in pipeline/; each runs its own main(argv)
PIPELINE_COMMANDS = {
    "job": "batch generation on Ray: a table of prompts in, Parquet generations and acceptance stats out "
           "(as jobs/generate.py)",
    "eval": "evaluation sweep on Ray: methods x engine settings on LongBench-format data, scored, one report "
            "(as jobs/eval.py)",
    "build-index": "prebuild a reference corpus's n-gram index for the job's --reference (as jobs/build_index.py)",
}


def _pipeline_main(command: str):
    """The ``main(argv, prog)`` of a pipeline command, imported now."""
    if command == "job":
        from pipeline.job.cli import main
    elif command == "eval":
        from pipeline.sweep.cli import main
    else:
        from pipeline.io.build_index import main
    return main


def _add_pipeline_commands(sub) -> None:
    for name, text in PIPELINE_COMMANDS.items():
        # no flags here: everything after the command goes to its own parser (``logitspec job --help``)
        p = sub.add_parser(name, help=text, add_help=False,
                           description=f"{text[0].upper()}{text[1:]}. Its flags: logitspec {name} --help.")
        p.set_defaults(pipeline=name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logitspec", description="One command for everything a user runs: the "
                                     "engine's (generate, bench, calibrate, throughput) and the Ray pipeline's.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    from .bench.calibrate_cli import add_calibrate_command
    from .bench.cli import add_bench_command
    from .bench.throughput import add_throughput_command

    add_bench_command(sub)
    add_calibrate_command(sub)
    add_throughput_command(sub)
    _add_pipeline_commands(sub)
    return parser


def main(argv=None) -> int:
    """The ``logitspec`` command; ``argv`` None: this process's own arguments, after re-executing
    itself once with tcmalloc where the machine has it (:mod:`logitspec.allocator`)."""
    if argv is None:
        allocator.reexec_with_tcmalloc()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "pipeline", None):  # its own parser, logging and exit codes
        return _pipeline_main(args.pipeline)(rest, prog=f"logitspec {args.pipeline}")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

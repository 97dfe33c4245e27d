"""``logitspec``: one command for everything a user runs.

The engine's commands (``generate``, ``bench``, ``calibrate``, ``throughput``, ``trace``, ``analyses``,
``rest-build``) and the Ray pipeline's (``job``, ``eval``, ``build-index``: the programs of ``jobs/*.py``,
same flags; ``report``: a finished job's run report). The pipeline's are
imported only when run, so this package still imports nothing of Ray or of :mod:`pipeline`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from logitspec.engine.request import add_request_flags, request_from_args

from . import allocator
from .config import METHODS, RUNNER_HELP, RUNNERS, SpecConfig
from .helpfmt import METHOD_HELP, DefaultsHelpFormatter


def _add_generate(sub) -> None:
    text = "generate a continuation for one or more prompts"
    p = sub.add_parser("generate", help=text, formatter_class=DefaultsHelpFormatter,
                       description=f"Generate: {text}, with the engine in this process. Each prompt's text "
                       "follows a header line; a statistics line (tokens, tokens/s, MAT, accepted draft "
                       "tokens) follows it (--json: one JSON object per sample instead).")
    p.add_argument("prompts", nargs="+", help="prompt text(s)")
    p.add_argument("--model", default="default", help="'default' (the embedded Gemma 3 270M), a HF model "
                   "dir, a .gguf file or a cached HF id")
    p.add_argument("--method", default="logitspec", choices=METHODS, help=METHOD_HELP)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--max-batch-size", type=int, default=1, help="prompts decoded together")
    p.add_argument("--runner", default="auto", choices=RUNNERS,
                   help=RUNNER_HELP)
    p.add_argument("--json", action="store_true", help="print token ids, text and stats as JSON")
    add_request_flags(p, max_new_tokens=64)
    p.set_defaults(func=_generate)


def stats_line(r) -> str:
    """A generation's statistics in one line: tokens, tokens/s, MAT and accepted draft tokens."""
    s, tokens = r.stats, len(r.token_ids)
    wall = s.get("wall_s") or 0.0
    lengths = s.get("accepted_lengths") or []
    drafted = sum(max(a - 1, 0) for a in lengths)
    rate = f"{tokens / wall:.1f} tok/s" if wall else "- tok/s"
    return (f"[{tokens} tokens, {rate}, MAT {s.get('mean_accepted', 0.0):.2f} over {s.get('steps', 0)} "
            f"steps, {drafted} accepted draft tokens, {r.finish_reason}]")


def _generate(args) -> int:
    config = SpecConfig(method=args.method, max_batch_size=args.max_batch_size, runner=args.runner)
    request = request_from_args(args)  # ValueError (exit 2) before the model loads
    from logitspec.engine.engine import Engine

    from .models import load_model

    model, tok = load_model(args.model)
    engine = Engine(model, tok, config)
    results = engine.generate(args.prompts, request, apply_chat_template=args.chat)
    n = request.n
    for k, r in enumerate(results):
        if args.json:
            print(json.dumps({"prompt": k // n, "sample": k % n, "token_ids": r.token_ids, "text": r.text,
                              "finish_reason": r.finish_reason, "stats": r.stats}))
            continue
        sample = f", sample {k % n + 1}/{n}" if n > 1 else ""
        print(f"=== prompt {k // n + 1}/{len(args.prompts)}{sample} ===")
        print(r.text)
        print(stats_line(r))
    return 0


def _add_analyses(sub) -> None:
    from .bench.analyses import add_arguments

    text = ("the paper's two analyses (next-next token in the top-k of the last logits, retrieval success) "
            "and the drafters at equal fixed budgets by replayed greedy acceptance")
    p = sub.add_parser("analyses", help=text, formatter_class=DefaultsHelpFormatter,
                       description=f"Analyses: {text} (as python -m logitspec.bench.analyses).")
    add_arguments(p)
    p.set_defaults(func=_analyses)


def _add_rest_build(sub) -> None:
    from logitspec.spec_decode.rest import add_build_arguments

    text = "build a REST datastore (for --method rest) from local text or code"
    p = sub.add_parser("rest-build", help=text, description=f"Rest-build: {text}, with its build time and "
                       "size (as python -m logitspec.spec_decode.rest build).")
    add_build_arguments(p)
    p.set_defaults(func=_rest_build)


def _rest_build(args) -> int:
    from logitspec.spec_decode.rest import run_build

    return run_build(args)


def _analyses(args) -> int:
    from .bench.analyses import run_from_args

    run_from_args(args)
    return 0


# the pipeline's programs (Ray): their flags live with them, in pipeline/; each runs its own main(argv)
PIPELINE_COMMANDS = {
    "job": "batch generation on Ray: a table of prompts in, Parquet generations and acceptance stats out "
           "(as jobs/generate.py)",
    "eval": "evaluation sweep on Ray: methods x engine settings on LongBench-format data, scored, one report "
            "(as jobs/eval.py)",
    "build-index": "prebuild a reference corpus's n-gram index for the job's --reference "
                   "(as jobs/build_index.py)",
    "report": "write a finished job's run report (_report.md and plots) into its output directory",
    "run-batch": "an OpenAI batch file through the job (-i requests.jsonl -o results.jsonl), as vllm "
                 "run-batch",
}


def _pipeline_main(command: str):
    """The ``main(argv, prog)`` of a pipeline command, imported now."""
    if command == "job":
        from pipeline.job.cli import main
    elif command == "eval":
        from pipeline.sweep.cli import main
    elif command == "report":
        from pipeline.job.report import main
    elif command == "run-batch":
        from pipeline.job.run_batch import main
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
    parser = argparse.ArgumentParser(
        prog="logitspec", description="One command for everything a user runs: the engine's (generate, "
        "bench, calibrate, throughput, trace, analyses, rest-build) and the Ray pipeline's (job, eval, "
        "build-index, report, run-batch).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    from .bench.calibrate_cli import add_calibrate_command
    from .bench.cli import add_bench_command
    from .bench.throughput import add_throughput_command
    from .bench.trace_cli import add_trace_command

    add_bench_command(sub)
    add_calibrate_command(sub)
    add_throughput_command(sub)
    add_trace_command(sub)
    _add_analyses(sub)
    _add_rest_build(sub)
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

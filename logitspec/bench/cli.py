"""``logitspec bench``'s command line: options, presets, the effective command and the console table."""
from __future__ import annotations

import shlex

from ..config import RUNNER_HELP, RUNNERS
from ..evaluation.longbench import read_directory
from ..helpfmt import DefaultsHelpFormatter
from .longbench_set import LONGBENCH_DIR
from .methods import DEFAULT_METHODS, parse_methods, split_top
from .questions import DEFAULT_QUESTIONS, load_questions
from .report import TASK_LABELS
from .results import rerender
from .run import bench
from .samples import add_decoding_options, decoding_from_args, decoding_options

QUICK = {"per_task": 1, "max_new_tokens": 16, "methods": "ar,logitspec,hf"}
DATA_SETS = ("spec_bench", "longbench")
DESCRIPTION = "Spec-Bench tables for our methods and the baselines users would pick instead."


def add_bench_command(sub) -> None:
    p = sub.add_parser("bench", help="Spec-Bench speedup / MAT tables for our methods and HF baselines",
                       description=DESCRIPTION, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="default", help="'default', a HF model dir, a .gguf file or a "
                                                      "cached HF id")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated (default {DEFAULT_METHODS}); variants as name@field=value[@...], "
                        "e.g. logitspec@capacity=8 or hf-pld@prompt_lookup_num_tokens=4; ar always runs")
    p.add_argument("--questions", default=None,
                   help=f"Spec-Bench question.jsonl (default: {DEFAULT_QUESTIONS})")
    p.add_argument("--data", default="spec_bench",
                   help="comma-separated question sets: spec_bench, longbench (the LongBench-format rows of "
                        "--longbench-dir, each data set a task, prompts built as `logitspec eval` builds "
                        "them, answers at most the data set's own length)")
    p.add_argument("--longbench-dir", default=str(LONGBENCH_DIR), help="a LongBench-format directory")
    p.add_argument("--per-task", type=int, default=None,
                   help="first N questions of each task (LongBench: rows of each data set) (default: all)")
    p.add_argument("--categories", default=None,
                   help="comma-separated Spec-Bench categories or tasks to keep (e.g. mt_bench,translation,"
                        "writing)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per turn (default 64)")
    p.add_argument("--max-batch-size", type=int, default=1, help="engine batch size; a unit is that many "
                                                                 "questions")
    p.add_argument("--capacity", type=int, default=None, help="SpecConfig.capacity for the engine methods")
    p.add_argument("--runner", default=None, choices=RUNNERS,
                   help="SpecConfig.runner for the engine methods (a variant's @runner= wins); "
                        + RUNNER_HELP)
    p.add_argument("--guesses", type=int, default=None,
                   help="SpecConfig.top_k for the engine methods: LogitSpec's next-next guesses per step")
    add_decoding_options(p)
    p.add_argument("--out", default="bench_out", help="output directory (default bench_out)")
    p.add_argument("--quick", action="store_true",
                   help="CI preset: 1 question per task, 16 new tokens, methods ar,logitspec,hf "
                        "(explicit options win)")
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="new tokens of each method's warm-up generation (not timed)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help="no progress line per question-turn")
    p.add_argument("--resume", action="store_true",
                   help="keep the complete question-turns already in --out's results.jsonl and run the rest")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="only re-render DIR's summary, report and plots from its results.jsonl (no model)")
    p.set_defaults(func=bench_command)


def bench_command(args) -> int:
    if args.report:
        summary = rerender(args.report)
        print(_console_table(summary))
        if summary.get("partial"):
            print(f"partial: {summary['partial']}")
        return 0
    decoding = decoding_from_args(args)  # bad sampling values fail before the model loads
    quick = QUICK if args.quick else {}
    per_task = args.per_task if args.per_task is not None else quick.get("per_task")
    max_new = args.max_new_tokens if args.max_new_tokens is not None else quick.get("max_new_tokens", 64)
    methods = [s.name for s in parse_methods(args.methods or quick.get("methods", DEFAULT_METHODS))]
    categories = split_top(args.categories, ",") if args.categories else None
    data = _data_sets(args.data)
    if "spec_bench" in data:
        load_questions(args.questions, per_task, categories)  # a missing file fails before the model loads
    longbench = None
    if "longbench" in data:
        longbench = args.longbench_dir
        read_directory(longbench)  # a missing or malformed directory fails before the model loads
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    summary = bench(args.model, args.questions, args.out, methods, per_task, categories,
                    max_new_tokens=max_new,
                    max_batch_size=args.max_batch_size, capacity=args.capacity, top_k=args.guesses,
                    runner=args.runner,
                    decoding=decoding,
                    warmup=not args.no_warmup, warmup_tokens=args.warmup_tokens,
                    progress=not args.no_progress, resume=args.resume,
                    spec_bench="spec_bench" in data, longbench=longbench,
                    command=_command_line(args, per_task, max_new, methods),
                    settings={"data": data, "questions_file": str(args.questions or DEFAULT_QUESTIONS),
                              "longbench_dir": longbench,
                              "per_task": per_task, "categories": categories, "quick": args.quick})
    print(_console_table(summary))
    print(f"wrote {args.out}/results.jsonl, summary.json, report.md, speedup.png, accept_hist.png")
    return 0


def _data_sets(text: str) -> list[str]:
    """``--data``'s sets, checked: ValueError on an unknown or missing name."""
    data = split_top(text, ",")
    unknown = sorted(set(data) - set(DATA_SETS))
    if unknown or not data:
        raise ValueError(f"--data: unknown question sets {unknown}; choose from {', '.join(DATA_SETS)}")
    return data


def _command_line(args, per_task, max_new, methods) -> str:
    """The effective command (presets resolved), so that the report says exactly what ran."""
    parts = ["logitspec", "bench", "--model", str(args.model), "--methods", ",".join(methods)]
    if args.data != "spec_bench":
        parts += ["--data", args.data]
    if args.questions:
        parts += ["--questions", str(args.questions)]
    if "longbench" in args.data and args.longbench_dir != str(LONGBENCH_DIR):
        parts += ["--longbench-dir", str(args.longbench_dir)]
    if per_task is not None:
        parts += ["--per-task", str(per_task)]
    if args.categories:
        parts += ["--categories", args.categories]
    parts += ["--max-new-tokens", str(max_new)]
    for opt in ("max_batch_size", "capacity", "guesses", "runner", "threads"):
        v = getattr(args, opt)
        if v is not None and not (opt == "max_batch_size" and v == 1):
            parts += ["--" + opt.replace("_", "-"), str(v)]
    parts += decoding_options(decoding_from_args(args))
    if args.no_warmup:
        parts.append("--no-warmup")
    elif args.warmup_tokens != 16:
        parts += ["--warmup-tokens", str(args.warmup_tokens)]
    parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(p) for p in parts)


def _console_table(summary: dict) -> str:
    cols = list(summary["tasks"]) + ["overall"]
    lines = ["method".ljust(24) + "".join(TASK_LABELS.get(c, c)[:9].rjust(10) for c in cols)
             + "MAT".rjust(7) + "lossless".rjust(10)]
    for m, v in summary["methods"].items():
        cells = "".join((f"{v['speedup'][c]:.2f}x" if v["speedup"].get(c) is not None else "-").rjust(10)
                        for c in cols)
        mat = v["mat"].get("overall")
        ll = v["lossless"]
        lines.append(m[:23].ljust(24) + cells + (f"{mat:.2f}" if mat is not None else "-").rjust(7)
                     + (f"{ll:.0%}" if ll is not None else "-").rjust(10))
    return "\n".join(lines)

"""``logitspec trace``: record acceptance traces with a real model, replay them on random weights."""
from __future__ import annotations

import json
import pathlib

from ..config import METHODS
from ..helpfmt import DefaultsHelpFormatter
from .longbench_set import LONGBENCH_DIR
from .questions import DEFAULT_QUESTIONS
from .throughput import parse_sizes
from .trace_record import DATASETS


def add_trace_command(sub) -> None:
    text = "record acceptance traces with a real model; replay them on random weights (replayed acceptance)"
    p = sub.add_parser("trace", help=text, formatter_class=DefaultsHelpFormatter,
                       description=f"Trace: {text}. See docs/gpu.md, 'Replayed acceptance'.")
    actions = p.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    r = actions.add_parser("record", formatter_class=DefaultsHelpFormatter,
                           help="decode prompts with the real engine and model; per step and row, keep "
                                "the verified tree's shape and the accepted node",
                           description="Record: one trace file per method "
                                       "(<model>_<dataset>_<method>.json.gz).")
    r.add_argument("--model", default="default", help="'default' (the embedded Gemma 3 270M), a HF model "
                   "dir, a .gguf file or a cached HF id")
    r.add_argument("--name", default=None, help="the model's name in the traces (default: from --model)")
    r.add_argument("--data", choices=DATASETS, default="spec_bench", help="the prompts")
    r.add_argument("--methods", default="pld,logitspec", help="methods to record (ar needs no trace)")
    r.add_argument("--per-task", type=int, default=1, help="first N questions per Spec-Bench task, or "
                   "rows per LongBench dataset")
    r.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most "
                   "(LongBench: also at most the dataset's own)")
    r.add_argument("--batch-size", type=int, default=1, help="rows decoded together while recording")
    r.add_argument("--questions", default=None,
                   help=f"Spec-Bench question.jsonl (default: {DEFAULT_QUESTIONS})")
    r.add_argument("--longbench-dir", default=str(LONGBENCH_DIR), help="a LongBench-format directory")
    r.add_argument("--out", default="traces", help="directory for the trace files")
    r.set_defaults(func=_record)
    y = actions.add_parser("replay", formatter_class=DefaultsHelpFormatter,
                           help="run the engine on a model of the same shape with random weights, trees and "
                                "accepted lengths from the traces: ms per token, speed-up over ar",
                           description="Replay: the engine's time per token with the traces' acceptance "
                                       "(labelled 'replayed acceptance').")
    y.add_argument("traces", nargs="+", help="trace files or directories of them")
    y.add_argument("--model", default="default", help="the model whose shape (config) is replayed")
    y.add_argument("--weights", choices=("random", "real"), default="random",
                   help="random weights of the model's shape, or the model's own")
    y.add_argument("--methods", default=None, help="comma-separated methods to replay (ar: the plain engine) "
                   "(default: ar and every method the traces recorded)")
    y.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    y.add_argument("--rounds", type=int, default=1, help="measured runs per case (the median is kept)")
    y.add_argument("--max-prompt-tokens", type=int, default=None, help="cut the replayed prompts to this "
                   "many tokens (default: the recorded lengths)")
    y.add_argument("--out", default=None, help="write the result as JSON here")
    y.set_defaults(func=_replay)


def _model_name(spec: str, model) -> str:
    if spec == "default":
        return "gemma3-270m"
    return pathlib.Path(str(getattr(model.config, "name_or_path", "") or spec)).name


def _engine_methods(text: str) -> list[str]:
    """``--methods``' comma-separated names; ValueError unless each is an engine method."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods or set(methods) - set(METHODS):
        raise ValueError(f"--methods must name methods of {', '.join(METHODS)}, got {text!r}")
    return methods


def _record(args) -> int:
    from ..models import load_model
    from .trace_record import record_all

    methods = _engine_methods(args.methods)
    model, tok = load_model(args.model)
    record_all(model, tok, methods, args.data, args.out, args.name or _model_name(args.model, model),
               batch_size=args.batch_size, per_task=args.per_task, max_new_tokens=args.max_new_tokens,
               questions=args.questions, longbench_dir=args.longbench_dir,
               meta={"command": f"logitspec trace record --model {args.model} --data {args.data} "
                                f"--methods {','.join(methods)} --per-task {args.per_task} "
                                f"--max-new-tokens {args.max_new_tokens} --batch-size {args.batch_size}"})
    return 0


def _replay(args) -> int:
    from logitspec.bench.replay_drafter import REPLAYED
    from logitspec.bench.trace import load_traces

    from ..models import load_model
    from .replay import random_like, render, replay

    methods = None if args.methods is None else _engine_methods(args.methods)
    traces = load_traces(args.traces)  # a bad file fails before the model loads
    model, _ = load_model(args.model)
    if args.weights == "random":
        model = random_like(model)
    result = replay(model, traces, methods, parse_sizes(args.batch_sizes), rounds=args.rounds,
                    max_prompt_tokens=args.max_prompt_tokens)
    result["weights"] = f"{args.model}, {args.weights} weights"
    print(f"{REPLAYED}: {result['weights']}\n")
    print(render(result))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0

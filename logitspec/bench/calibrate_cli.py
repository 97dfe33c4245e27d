"""``logitspec calibrate``: measure this machine's forward cost curve t(n) of a model, store it where
engines with ``SpecConfig(budget="auto")`` find it, print it and optionally plot it.

The measuring and the store are :mod:`logitspec.worker.calibrate`'s; this is the command line around them. The
forwards run through the runner the engine would use (``--runner default``: the CUDA-graph runner on
CUDA, the eager forward elsewhere), which is part of the stored curve's key.
"""
from __future__ import annotations

from logitspec.worker.calibrate import (
    TOKENS,
    curve_path,
    grid_for,
    machine_fingerprint,
    measure,
    runner_fingerprint,
    save,
)

from ..helpfmt import DefaultsHelpFormatter


def add_calibrate_command(sub) -> None:
    text = "measure and store the forward cost curve t(n) of a model here"
    p = sub.add_parser("calibrate", help=text, formatter_class=DefaultsHelpFormatter, description=(
        f"Calibrate: {text}. Times the model's forward at several batch sizes and new-token counts per row "
        "(on this machine, with its current load), stores the curve under ~/.cache/logitspec (keyed by "
        "model, device, dtype, machine and runner) where engines with --budget auto find it, and prints "
        "it. The auto budget verifies a draft only where this curve says its expected accepted tokens pay "
        "for the longer forward; without a stored curve an engine measures a quick one at start-up."))
    p.add_argument("--model", default="default",
                   help="'default' (the embedded Gemma 3 270M), a HF model dir, a .gguf file or a cached "
                        "HF id")
    p.add_argument("--context", type=int, default=None,
                   help="cached tokens before the measured forward (default: 256 on CPU, 1024 on a GPU)")
    p.add_argument("--device", default="cpu",
                   help="where to measure: cpu, or e.g. cuda (batch sizes 8, 32, 64 with 1-64 tokens per "
                        "row)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the model's dtype while measuring (as the engine will run it)")
    p.add_argument("--runner", default="default", choices=["default", "eager", "graph"],
                   help="what runs the forwards: the engine's default (the CUDA-graph runner on CUDA, the "
                        "eager forward elsewhere), the eager forward, or the graph runner (uncaptured off "
                        "CUDA)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per point (the median is kept)")
    p.add_argument("--plot", default=None, help="write the curve as a PNG here")
    p.set_defaults(func=calibrate_command)


def calibrate_command(args) -> int:
    from ..models import load_model

    model, _ = load_model(args.model, device=args.device, dtype=args.dtype)
    target = make_runner(model, args.runner, args.context)
    curve = measure(target, TOKENS, context=args.context, reps=args.reps)
    path = curve_path(model, head=target.head, runner=runner_fingerprint(target))
    if path is not None:
        save(curve, path, target)
    print(f"machine: {machine_fingerprint(next(model.parameters()).device)}")
    print(f"runner: {runner_fingerprint(target)}")
    print(curve_table(curve))
    if path is not None:
        print(f"stored: {path}")
    if args.plot:
        plot_curve(curve, args.plot, f"forward cost: {args.model}")
    return 0


def make_runner(model, kind: str, context: int | None = None):
    """The runner ``kind`` names for ``model`` ("default", "eager", "graph"), with slots for the
    device's grid: its most rows, each the grid's context plus 16 a row and the largest node bucket
    (on CUDA, the default runner's slots: the model's context, within half the free memory)."""
    from logitspec.worker.eager_runner import EagerRunner
    from logitspec.worker.gpu import NODE_BUCKETS, GraphRunner, default_runner

    device = next(model.parameters()).device
    grid = grid_for(device)
    rows = max(grid.rows)
    if kind == "eager":
        return EagerRunner(model)
    if kind == "default" or device.type == "cuda":  # on CUDA the default runner is the graph runner
        return default_runner(model, rows)
    max_len = (context or grid.context) + 16 * rows + 2 * max(NODE_BUCKETS)
    return GraphRunner(model, max_rows=rows, max_len=-(-max_len // 128) * 128)


def curve_table(curve) -> str:
    """Markdown tables: ms per forward by new tokens (one row), then by new tokens per row per batch size."""
    lines = ["| new tokens | forward ms | x one token |", "|---|---|---|"]
    lines += [f"| {n} | {s * 1000:.1f} | {s / curve.seconds[0]:.2f} |" for n, s in zip(curve.tokens,
                                                                                       curve.seconds)]
    for b, c in curve.batches.items():
        lines += ["", f"{b} rows:", "| new tokens per row | forward ms | x one token per row |",
                  "|---|---|---|"]
        lines += [f"| {n} | {s * 1000:.1f} | {s / c.seconds[0]:.2f} |" for n, s in zip(c.tokens, c.seconds)]
    return "\n".join(lines)


def plot_curve(curve, path, title: str) -> None:
    """The one-row curve, ms against new tokens, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(curve.tokens, [s * 1000 for s in curve.seconds], marker="o")
    ax.set_xlabel("new tokens in the forward")
    ax.set_ylabel("ms")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)

"""Batched throughput: tokens/s of methods at several batch sizes, side by side in one process.

``logitspec throughput --batch-sizes 1,4,8 --methods ar,logitspec`` runs the same prompts through
``Engine.run`` for every (batch size, method), rounds interleaved so machine noise hits all
alike, after a warm-up on a built-in prompt that is not measured, and prints a table of median
tokens/s and the ratio to ``ar``. A batch size larger than the prompt list runs the list repeated
until every row is filled (batch 24 over 6 prompts: each four times). Engines live for all rounds:
from the second round on, a ``logitspec`` engine's learned acceptance rates include the earlier
rounds' (same) prompts. ``--baselines vllm`` adds vLLM's CPU backend on the same token ids: its
engines start first and stay resident (:class:`logitspec.bench.vllm_baseline.Runner`), their
rounds in the same rotation as ours, so a drifting machine slows both alike and the paired ratios
cover vLLM's rows too.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import statistics
import sys
import time

from ..config import SpecConfig
from ..helpfmt import DefaultsHelpFormatter
from . import vllm_baseline
from .methods import ENGINE_OPTIONS, parse_methods
from .questions import DEFAULT_QUESTIONS, first_turns, warmup_question
from .samples import Decoding, add_decoding_options, decoding_from_args, run_samples

BASELINES = ("vllm",)
DTYPES = ("float32", "bfloat16")  # --dtype: the model's, ours and vLLM's


def batch_prompts(prompts: list, batch_size: int) -> list:
    """What batch size ``batch_size`` runs: ``prompts``, repeated as often as needed to fill its rows."""
    return list(prompts) * max(1, -(-batch_size // len(prompts)))


def run(model, tokenizer, prompts, methods, batch_sizes, max_new_tokens: int, rounds: int = 2,
        configs: dict[str, SpecConfig] | None = None, decoding: Decoding = Decoding(),
        prompts_per_slot: int = 1, baselines: dict | None = None) -> dict:
    """``{"<method>@<batch>": row}``: median tokens/s over ``rounds``, the ratio to ``ar`` at the same
    batch size (of the medians, and ``vs_ar_paired``: the median of each round's own ratio, which a
    machine whose speed drifts between rounds moves less), MAT of the last round, the last round's
    new token ids and whether they equal ``ar``'s (sampled: the same draws from the same seeds).
    ``decoding``: greedy, or sampled with ``num_samples`` per prompt. ``prompts_per_slot``: batch
    size b runs ``b x prompts_per_slot`` prompts through its b slots (1: one static batch, which ends
    with its slowest row; more: slots refilled as rows finish, as in a job). ``baselines``: other
    engines' resident runners, ``{(name, b): runner}`` with ``runner.round(b, token_ids, slots)``
    (:class:`~logitspec.bench.vllm_baseline.Runner`), run on the prompts' token ids in the same
    rotation as ours; one that fails is reported and dropped from the table."""
    from logitspec.engine.engine import Engine

    given = configs or {}
    configs = {m: given[m] if m in given else SpecConfig(method=m) for m in methods}  # a variant's is given
    engines = {(m, b): Engine(model, tokenizer, configs[m].with_(max_batch_size=b))
               for m in methods for b in batch_sizes}
    # warm-up (and the auto budget's first calibration) on a prompt that is not measured
    warm = warmup_question(tokenizer, model.config.get_text_config(decoder=True).vocab_size).turns[0]
    for e in engines.values():
        e.generate([warm], max_new_tokens=8)
    contenders = {k: _engine_round(e, prompts, k[1] * prompts_per_slot, max_new_tokens, decoding)
                  for k, e in engines.items()}
    baselines = baselines or {}
    ids = [tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompts] if baselines else []
    contenders.update({(name, b): _baseline_round(r, b, batch_prompts(ids, b * prompts_per_slot),
                                                  prompts_per_slot > 1)
                       for (name, b), r in baselines.items()})
    tps = {k: [] for k in contenders}
    outputs, mats = {}, {}
    for r in range(rounds):
        keys = [k for k in contenders if k in tps]
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            try:
                tokens_per_s, outputs[k], mats[k] = contenders[k]()
            except (RuntimeError, TimeoutError) as e:
                if k not in baselines:
                    raise  # our own engines' errors are bugs
                print(f"{k[0]} dropped: {e}", file=sys.stderr)  # a baseline's engine failed: the rest stands
                del tps[k]
                continue
            tps[k].append(tokens_per_s)
    table = {}
    for b in batch_sizes:
        base = tps.get(("ar", b))
        for m in [m for m in dict.fromkeys(n for n, _ in tps) if (m, b) in tps]:
            t = statistics.median(tps[(m, b)])
            paired = statistics.median(x / a for x, a in zip(tps[(m, b)], base)) if base else None
            table[f"{m}@{b}"] = {
                "method": m, "batch_size": b, "tokens_per_s": t,
                "vs_ar": t / statistics.median(base) if base else None, "vs_ar_paired": paired,
                "mat": mats[(m, b)],
                "same_as_ar": outputs[(m, b)] == outputs[("ar", b)] if ("ar", b) in outputs else None,
                "rounds": tps[(m, b)], "token_ids": outputs[(m, b)],
            }
        _against_our_best(table, b, {name for name, _ in baselines})
    return table


def _against_our_best(table: dict, b: int, baseline_names: set[str]) -> None:
    """Add to each baseline row at batch size ``b`` how our best method there (the highest median
    tokens/s) compares with it: ``vs_our_best`` (ratio of the medians), ``our_best_per_round`` (each
    round's own ratio: both ran in the same rotation) and ``our_best`` (the method)."""
    rows = [r for r in table.values() if r["batch_size"] == b]
    ours = [r for r in rows if r["method"] not in baseline_names]
    if not ours:
        return
    best = max(ours, key=lambda r: r["tokens_per_s"])
    for row in (r for r in rows if r["method"] in baseline_names):
        row["our_best"] = best["method"]
        row["vs_our_best"] = best["tokens_per_s"] / row["tokens_per_s"] if row["tokens_per_s"] else None
        row["our_best_per_round"] = [o / v for o, v in zip(best["rounds"], row["rounds"]) if v]


def _engine_round(engine, prompts, count: int, max_new_tokens: int, decoding: Decoding):
    """One round of our engine on ``count`` of the (repeated) prompts: (tokens/s, token ids, MAT)."""
    def go():
        done = run_samples(engine, batch_prompts(prompts, count), max_new_tokens, decoding)
        mat = statistics.mean(x.stats["mean_accepted"] for x in done.results)
        return done.stats["tokens_per_s"], [x.token_ids for x in done.results], mat
    return go


def _baseline_round(runner, batch_size: int, ids: list[list[int]], slots: bool):
    """One round of another engine's resident runner: (tokens/s, token ids, no MAT)."""
    def go():
        rec = runner.round(batch_size, ids, slots)
        return float(rec["tokens_per_s"]), [[int(t) for t in o] for o in rec["token_ids"]], None
    return go


def render(table: dict) -> str:
    lines = ["| batch | method | tokens/s | vs ar | vs ar, paired by round | MAT | output == ar |",
             "|---|---|---|---|---|---|---|"]
    for row in table.values():
        vs, paired = (f"{row[k]:.2f}x" if row.get(k) else "-" for k in ("vs_ar", "vs_ar_paired"))
        mat = f"{row['mat']:.2f}" if row["mat"] is not None else "-"
        lines.append(f"| {row['batch_size']} | {row['method']} | {row['tokens_per_s']:.2f} | {vs} | "
                     f"{paired} | "
                     f"{mat} | {row['same_as_ar']} |")
    against = [r for r in table.values() if r.get("our_best")]
    if against:
        lines += ["", "| batch | our best | baseline | our best / baseline, medians | per round: median "
                      "(min-max) "
                      "| rounds ours ahead |", "|---|---|---|---|---|---|"]
        for row in against:
            per = row["our_best_per_round"]
            spread = f"{statistics.median(per):.2f}x ({min(per):.2f}-{max(per):.2f})" if per else "-"
            ratio = f"{row['vs_our_best']:.2f}x" if row["vs_our_best"] else "-"
            lines.append(f"| {row['batch_size']} | {row['our_best']} | {row['method']} | {ratio} | "
                         f"{spread} | "
                         f"{sum(x > 1 for x in per)} of {len(per)} |")
    return "\n".join(lines)


def add_throughput_command(sub) -> None:
    text = "tokens/s of methods at several batch sizes, side by side"
    p = sub.add_parser("throughput", help=text, description=f"Throughput: {text}.",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="default",
                   help="'default' (the embedded Gemma 3 270M), a HF model dir, a .gguf file or a cached "
                        "HF id")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the model's dtype, ours and vLLM's (bfloat16 on CPU: lossless where oneDNN runs "
                        "bfloat16 GEMMs, see docs/gpu.md)")
    p.add_argument("--methods", default="ar,logitspec",
                   help="engine methods and variants (logitspec@capacity=8); ar is always run")
    p.add_argument("--batch-sizes", default="1,4,8", help="comma-separated engine batch sizes to measure")
    p.add_argument("--questions", default=None, help=f"Spec-Bench question.jsonl (default: "
                                                     f"{DEFAULT_QUESTIONS})")
    p.add_argument("--per-task", type=int, default=2, help="first N questions of each Spec-Bench task")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most")
    p.add_argument("--rounds", type=int, default=2,
                   help="times each (method, batch size) is run, interleaved; the table gives the median")
    p.add_argument("--prompts-per-slot", type=int, default=1,
                   help="batch size b runs b x N prompts (1: one static batch, done when its slowest row is; "
                        "more: rows are refilled as they finish, as in a job; vLLM likewise, one engine "
                        "start-up "
                        "per batch size)")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    p.add_argument("--baselines", default="", help="other engines to run on the same prompts: 'vllm' (vLLM's "
                   "CPU backend, in --dtype, in its own environment; skipped with a message when absent)")
    p.add_argument("--vllm-python", default=None, help="python of vLLM's environment (default "
                   "~/.cache/logitspec/vllm-venv/bin/python)")
    p.add_argument("--vllm-methods", default="plain,ngram",
                   help=f"vLLM methods to run, of {','.join(vllm_baseline.METHODS)} (ngram: 5 drafted "
                        f"tokens; "
                        "suffix needs arctic-inference in vLLM's environment)")
    add_decoding_options(p)
    p.set_defaults(func=_main)


def _main(args) -> int:
    from ..models import load_model

    specs = parse_methods(args.methods)  # fails fast on a typo; variants as in bench: logitspec@capacity=8
    if any(s.is_hf or set(s.overrides) & set(ENGINE_OPTIONS) for s in specs):
        raise ValueError(f"throughput runs this engine's methods and SpecConfig variants only, got "
                         f"{args.methods!r}")
    methods = [s.name for s in specs]
    configs = {s.name: SpecConfig(method=s.base, **s.overrides) for s in specs}
    sizes = parse_sizes(args.batch_sizes)
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    if set(baselines) - set(BASELINES):
        raise ValueError(f"unknown baselines {sorted(set(baselines) - set(BASELINES))}; known: "
                         f"{', '.join(BASELINES)}")
    vllm_methods = vllm_baseline.parse_methods(args.vllm_methods) if baselines else []
    vllm_python = None
    if "vllm" in baselines:
        vllm_python, why = vllm_baseline.find_python(args.vllm_python)
        if vllm_python is None:
            print(why)
    if args.prompts_per_slot < 1:
        raise ValueError(f"--prompts-per-slot must be >= 1, got {args.prompts_per_slot}")
    decoding = decoding_from_args(args)
    if vllm_python is not None and not decoding.greedy:
        print("vLLM baseline skipped: it is compared under greedy decoding only")
        vllm_python = None
    # the first turn of the first N questions of each task; long turns cut to 1500 characters
    prompts = first_turns(args.questions, args.per_task, max_chars=1500)
    model, tok = load_model(args.model, dtype=args.dtype)
    with contextlib.ExitStack() as stack:
        runners = _start_vllm(stack, vllm_python, vllm_methods, model, tok, sizes,
                              args) if vllm_python else {}
        t0 = time.perf_counter()
        table = run(model, tok, prompts, methods, sizes, args.max_new_tokens, args.rounds, configs, decoding,
                    args.prompts_per_slot, baselines=runners)
    print(render(table))
    print(f"\n{len(prompts)} prompts, {args.prompts_per_slot} per slot, {args.dtype}, {decoding.describe()}, "
          f"{args.max_new_tokens} new tokens, {args.rounds} rounds, "
          f"{time.perf_counter() - t0:.0f} s")
    if args.out:
        slim = {k: {f: v for f, v in row.items() if f != "token_ids"} for k, row in table.items()}
        pathlib.Path(args.out).write_text(json.dumps(slim, indent=1))
    return 0


def _start_vllm(stack, python, methods, model, tok, sizes, args) -> dict:
    """vLLM's resident runners for ``methods`` (entered into ``stack``), warmed up on our warm-up prompt."""
    import torch

    warm = warmup_question(tok, model.config.get_text_config(decoder=True).vocab_size).turns[0]
    warm_ids = tok(warm).input_ids if isinstance(warm, str) else list(warm)
    return vllm_baseline.start_runners(python, model.config._name_or_path, methods, sizes,
                                       args.max_new_tokens, warm_ids, stack, threads=torch.get_num_threads(),
                                       slots=args.prompts_per_slot > 1, dtype=args.dtype)


def parse_sizes(text: str) -> list[int]:
    """``1,6,24`` -> [1, 6, 24]; ValueError unless all are positive integers."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers separated by commas, got {text!r}")
    return sizes

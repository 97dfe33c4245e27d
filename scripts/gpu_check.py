"""The device check (docs/gpu.md, "The device check"), in one run: by default the graph runner's parts, with
``--parts all`` also the eager parts (eager lossless, device paths, cost curves).
Writes JSON under ``--out``; on CPU (``--tiny``) every part runs in its CPU form.

    bash scripts/gpu_check.sh "$OUT"                                  # on the GPU (under 7 minutes)
    python scripts/gpu_check.py --tiny --device cpu --out out/check   # CI-sized, on CPU

The graph runner's parts, in order of what their figures are worth (each with a share of the time left:
:data:`SHARE`; each case or point in its own ``try``, none started past its part's deadline):

1. ``graph_lossless.json``: the whole engine through the graph runner (``logitspec.worker.gpu``: static KV
   slots, one CUDA graph per (rows, nodes) bucket), ``ar`` and ``logitspec`` on tiny Llama, Qwen2
   and Gemma 3: float32 against HF ``generate``, bfloat16 against our bfloat16 ``ar``; flex attention
   on head-dim-32 copies, uncompiled and compiled steps (``counters.uncompiled``: compiled steps the
   runner's check rejected).
2. ``ar_steps.json``: our engine's ``ar`` step through the graph runner the engine makes on this device
   (flex attention on CUDA, its buckets built at start-up) at 1, 8, 32, 64 rows, greedy and sampled
   (T 0.8, top-p 0.95): a warm-up run, then the same run timed (ms per steady step, its captures, its
   host waits by code location); then the same through a runner attending the other way (``variant``).
3. ``graph_timing.json``: the graph runner's step on the Llama-3-8B shape (random bfloat16 weights, as
   every part below) at rows x nodes per row, the engine's attention first (flex on CUDA: the tree
   goals' points), then SDPA at 1/8/32/64 rows x 1..32 nodes and SDPA pinned to each kernel at a few
   points: the tree curve; captures and allocations on repeated shapes.
4. ``replay.json``: replayed acceptance (docs/gpu.md): the traces in ``docs/results/traces`` (trees and
   accepted lengths recorded by a real model on CPU) through the whole engine at 1, 8 and 32 rows, a
   row per recorded method and ``ar``: ms per token and the speed-up over ``ar``.
5. ``prefill_8k.json``: an 8192-token prompt prefilled the engine's way and straight into a slot.
6. ``hf_graph.json``: the reference step, HF's forward over a ``StaticCache`` captured once in a CUDA
   graph and replayed (1 and 32 rows, 512-token prompts).
7. ``compiled_timing.json``: the compiled step (flex attention; a compile per point) at the goals' points.
8. ``summary.json`` (scripts/gpu_check_summary.py, written after every part): versions, device,
   per-part time and errors, every promised key (null with its reason in ``nulls``), and per figure how
   its steps ran (``runs``: captured, compiled, steps that fell back). Exit 1 if a lossless case failed or
   a part raised (its error is recorded; the other parts still run).

The eager parts: ``lossless.json`` (the eager engine against ``generate`` / our bfloat16 ``ar``),
``device_paths.json`` (host waits per step of the eager engine, sampling on the device),
``curve_<shape>.json`` (the eager forward's cost at 1/8/32/64 rows x 1..64 nodes per row for a
Llama-3-8B and a Qwen2.5-7B shape, the speed-up it predicts, the engine's step split and host profile).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import json
import math
import os
import pathlib
import platform
import pstats
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass

REPO = pathlib.Path(__file__).resolve().parents[1]
TRACES = REPO / "docs" / "results" / "traces"  # the replay part's recorded acceptance (docs/gpu.md)
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402
from gpu_check_steps import ar_steps, count_host_waits, hf_graph_steps, prefill_timings  # noqa: E402
from gpu_check_summary import summarise  # noqa: E402
from gpu_check_summary import write as write_summary  # noqa: E402
from tiny_models import FAMILIES, repetitive_prompts, tiny_model  # noqa: E402

from logitspec import Engine, SpecConfig  # noqa: E402
from logitspec.device import fastest  # noqa: E402
from logitspec.engine.request import Request  # noqa: E402
from logitspec.models.merged_projections import merge_projections  # noqa: E402
from logitspec.sample.node_logits import OutputMode  # noqa: E402
from logitspec.spec_decode.budget import CostCurve  # noqa: E402
from logitspec.worker.calibrate import measure_rows  # noqa: E402
from logitspec.worker.eager_runner import EagerRunner  # noqa: E402
from logitspec.worker.masks import StepRow  # noqa: E402

SHAPES = {  # the real models' shapes; weights are random (nothing on disk)
    "llama3-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=8,
                                intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4,
                                 intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768)),
}
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, max_position_embeddings=2048)
# measured on CPU, batch 1, Spec-Bench, 128 new tokens (docs/benchmarks.md): (what, MAT, draft nodes per step)
CPU_ACCEPTANCE = [("gemma3-270m logitspec, run 1", 2.90, 4.5), ("gemma3-270m logitspec, run 2", 2.72, 3.2),
                  ("gemma3-270m pld", 3.02, 5.3), ("qwen2.5-coder-0.5b logitspec", 1.68, 2.5),
                  ("qwen2.5-coder-0.5b pld", 1.76, 5.2)]
# a parting's logit gap allowed, relative to max |logit|
TIE = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -6}


@dataclass(frozen=True)
class Plan:
    device: str
    prompts: int = 8
    new_tokens: int = 32
    batch: int = 4
    rows: tuple = (1, 8, 32, 64)
    nodes: tuple = (1, 2, 4, 8, 16, 32, 64)
    context: int = 1024  # row r caches context + 16 r tokens: 1024-2032 at 64 rows
    reps: int = 3
    step_tokens: int = 32  # new tokens per row in the engine-step measurement (trees shrink near the end)
    shapes: tuple = tuple(SHAPES)
    tiny: bool = False
    prompt_len: int = 512  # the decode-step parts' prompts (512-token prompts, as the goals' table)
    hf_rows: tuple = (1, 32)  # rows of the HF reference step
    ar_tokens: int = 32  # new tokens per row in the ar-step part (each run twice: warm-up, timed)
    prefill_tokens: int = 8192
    prefill_chunk: int = 512  # the engine's default prefill chunk
    replay_rows: tuple = (1, 8, 32)  # batch sizes of the replayed-acceptance part (rows repeat the traces')
    replay_prompt_tokens: int | None = 2048  # replayed prompts cut to this many tokens (None: as recorded)


def plan_for(args) -> Plan:
    if not args.tiny:
        return Plan(args.device)
    # the 8B shape's row and node counts (every summary key has a value), on a tiny model
    return Plan(args.device, prompts=3, new_tokens=12, batch=2, rows=(1, 8, 32, 64), nodes=(1, 4, 8, 16),
                context=24, reps=1, step_tokens=4, tiny=True, prompt_len=24, ar_tokens=6, prefill_tokens=256,
                prefill_chunk=64, replay_rows=(1, 8), replay_prompt_tokens=16)


# ------------------------------------------------------------------------------------------ lossless
def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def parting(model, prompt, ref: list[int], got: list[int]) -> dict | None:
    """Where ``got`` first differs from ``ref``, and the reference's logit gap between the two tokens."""
    if got == ref:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    if at >= min(len(got), len(ref)):
        return {"at": at, "gap": None, "tie": False, "note": "lengths differ"}
    logits = model(torch.tensor([prompt + ref[:at]], device=model.device)).logits[0, -1].float()
    gap = float(logits[ref[at]] - logits[got[at]])
    tol = TIE[model.dtype] * max(1.0, float(logits.abs().max()))
    return {"at": at, "gap": gap, "tol": tol, "tie": abs(gap) <= tol}


def compare(model, prompts, refs, outs) -> dict:
    parts = [(i, parting(model, p, r, o)) for i, (p, r, o) in enumerate(zip(prompts, refs, outs))]
    partings = [{"prompt": i, **d} for i, d in parts if d is not None]
    return {"equal": len(prompts) - len(partings), "of": len(prompts), "partings": partings,
            "ok": all(d["tie"] for d in partings)}


def run_engine(model, prompts, plan: Plan, method: str, batch: int, **kw):
    budget = kw.pop("budget", "fixed")
    engine = Engine(model, None, SpecConfig(method=method, max_batch_size=batch, budget=budget),
                    **{"runner": EagerRunner(model), **kw.pop("engine", {})})  # eager unless asked
    run = engine.run(prompts, max_new_tokens=plan.new_tokens, **kw)
    mat = sum(len(r.token_ids) for r in run.results) / max(1, sum(r.stats["steps"] for r in run.results))
    info = {"method": method, "batch": batch, "budget": budget, "mat": round(mat, 3),
            "tokens_per_s": round(run.stats["tokens_per_s"], 1)}
    return [r.token_ids for r in run.results], info


def lossless_family(family: str, plan: Plan) -> list[dict]:
    """float32 against HF generate; bfloat16 against our bfloat16 ar (required) and generate
    (informational)."""
    prompts = repetitive_prompts(plan.prompts, seed=1)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(family).to(device=plan.device, dtype=dtype)
        hf = [hf_generate(model, p, plan.new_tokens) for p in prompts]
        ref = hf if dtype == torch.float32 else run_engine(model, prompts, plan, "ar", 1)[0]
        runs = [("ar", 1, {}), ("pld", 1, {}), ("logitspec", 1, {}), ("ar", plan.batch, {}),
                ("pld", plan.batch, {}),
                ("logitspec", plan.batch, {}), ("logitspec", plan.batch, {"budget": "auto"})]
        for method, batch, kw in runs:
            outs, info = run_engine(model, prompts, plan, method, batch, **kw)
            case = {"family": family, "dtype": str(dtype).split(".")[-1], **info,
                    "reference": "generate" if dtype == torch.float32 else "ar bfloat16 batch 1",
                    **compare(model, prompts, ref, outs)}
            if dtype != torch.float32:
                case["vs_generate"] = {k: v for k, v in compare(model, prompts, hf, outs).items()
                                       if k != "ok"}
            cases.append(case)
        del model
    return cases


def host_waits(plan: Plan) -> dict:
    """Host waits for the device in a batched logitspec run, by code location (CUDA only)."""
    if not plan.device.startswith("cuda"):
        return {"measured": False, "why": "CUDA's sync debug mode exists on CUDA only"}
    model = tiny_model("qwen2").to(plan.device)
    prompts = repetitive_prompts(plan.prompts, seed=2)
    run_engine(model, prompts, plan, "logitspec", plan.batch)  # warm-up
    engine = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=plan.batch, budget="fixed"),
                    runner=EagerRunner(model))
    with count_host_waits(torch.device(plan.device)) as where:
        run = engine.run(prompts, max_new_tokens=plan.new_tokens)
    steps = run.stats["batch_steps"]
    return {"measured": True, "batch_steps": steps, "admissions": len(prompts), "waits": sum(where.values()),
            "waits_per_step": round(sum(where.values()) / steps, 2), "by_location": dict(where.most_common())}


def device_sampling(plan: Plan) -> dict:
    """Seeded sampling with every node drawn where the logits are: runs, and stays in the vocabulary."""
    model = tiny_model("gemma3").to(device=plan.device, dtype=torch.bfloat16)
    prompts = repetitive_prompts(plan.prompts, seed=3)
    outs, info = run_engine(model, prompts, plan, "logitspec", plan.batch, temperature=0.8, top_p=0.95,
                            seed=7, engine={"sample_on_host": False})
    ok = all(len(o) == plan.new_tokens and all(0 <= t < model.config.vocab_size for t in o) for o in outs)
    return {**info, "ok": ok}


# ------------------------------------------------------------------------------------------ cost curves
def build_shape(name: str, plan: Plan, merged: bool = True):
    """A model of that shape with random bfloat16 weights, made on the device (or a tiny stand-in),
    its projections merged as ``load_model`` merges them off CPU (``merged``; stock HF's otherwise)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, dims = SHAPES[name]
    cfg = AutoConfig.for_model(family, **(TINY_SHAPE if plan.tiny else dims), attn_implementation="sdpa",
                               eos_token_id=None, bos_token_id=None, pad_token_id=None)
    with torch.device(plan.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if merged:
        merge_projections(model)
    return model.eval(), cfg


def predict(curve: CostCurve, rows: list[int]) -> list[dict]:
    """Speed-up over plain decoding if MAT measured on CPU at ``nodes`` draft nodes per step held here:
    MAT / (t(rows, nodes + 1) / t(rows, 1)). A prediction: no host overhead, other models' acceptance."""
    out = []
    for what, mat, nodes in CPU_ACCEPTANCE:
        n = 1 + math.ceil(nodes)  # the root is verified too
        if n <= curve.tokens[-1]:  # within the measured nodes per row, never extrapolated
            out.append({"acceptance": what, "mat": mat, "tokens_per_row": n,
                        **{str(b): round(mat * curve.step(b, 1) / curve.step(b, n), 2) for b in rows}})
    return out


def engine_steps(model, plan: Plan) -> tuple[dict, list[str]]:
    """The whole engine's decode step on this shape at 1 row and the most rows, beside the forward:
    random weights accept almost nothing, but trees are built, packed, verified and committed, so the
    host's share (drafting, packing, the walk) shows. ms per step, split as in the engine's stats;
    and the host's time by function in the ``ar`` run at 1 row."""
    out, host = {}, []
    for b in (1, plan.rows[-1]):
        # a repeating pattern, so lookups find continuations and trees fill up
        vocab = min(1000, model.config.vocab_size)
        prompts = [[(31 * (i % 50) + r) % vocab for i in range(plan.context)] for r in range(b)]
        for method, extra in (("ar", {}), ("logitspec", {"budget": "fixed", "capacity": 16})):
            engine = Engine(model, None, SpecConfig(method=method, max_batch_size=b, **extra),
                            runner=EagerRunner(model))
            profile = cProfile.Profile() if b == 1 and method == "ar" else None
            with profile or contextlib.nullcontext():
                run = engine.run(prompts, max_new_tokens=plan.step_tokens)
            if profile is not None:  # the host's time by function, where the step's time goes
                host = top_functions(profile)
            s = run.results[0].stats  # every row is charged the whole step
            n = max(1, s["steps"] - 1)
            parts = ("draft_s", "pack_s", "forward_s", "verify_s", "commit_s")
            split = {k[:-2]: round(s[k] / n * 1e3, 2) for k in parts}
            out[f"{method}@{b}"] = {"ms_per_step": round(sum(split.values()), 2), "split_ms": split,
                                    "mean_tree_size": round(s["mean_tree_size"], 1), "decode_steps": n}
    return out, host


def top_functions(profile: cProfile.Profile, n: int = 25) -> list[str]:
    """The ``n`` functions with the most time of their own, one line each."""
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, calls, own s, total s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [f"{v[2] * 1e3:9.1f} ms own {v[3] * 1e3:9.1f} ms total {v[1]:7d} calls  "
            f"{pathlib.Path(k[0]).name}:{k[1]}({k[2]})" for k, v in rows]


def curve_for(name: str, plan: Plan, deadline: float) -> dict:
    """t(rows, nodes per row) of one shape; rows are skipped once the time budget runs short."""
    t0 = time.time()
    model, cfg = build_shape(name, plan)
    target = EagerRunner(model)
    doc = {"shape": name, "dtype": "bfloat16", "attn": model.config._attn_implementation,
           "context": plan.context,
           "config": {k: getattr(cfg, k) for k in (TINY_SHAPE if plan.tiny else SHAPES[name][1])},
           "build_s": round(time.time() - t0, 1), "rows": {}, "skipped_rows": []}
    curves, last_s = {}, 0.0
    for b in plan.rows:
        if time.time() + 3 * last_s > deadline:
            doc["skipped_rows"].append(b)
            continue
        t1 = time.time()
        c = measure_rows(target, b, plan.nodes, plan.context, plan.reps, warmup=1)
        last_s = time.time() - t1
        curves[b] = c
        doc["rows"][str(b)] = {"nodes_per_row": c.tokens, "ms": [round(s * 1e3, 3) for s in c.seconds],
                               "x_plain": [round(s / c.seconds[0], 3) for s in c.seconds],
                               "measure_s": round(last_s, 1)}
    if 1 in curves:
        one = curves.pop(1)
        curve = CostCurve(one.tokens, one.seconds, curves)
        doc["cost_curve"] = curve.to_dict()
        doc["prediction"] = predict(curve, [b for b in plan.rows if b == 1 or b in curves])
    if time.time() + 2 * last_s < deadline:
        doc["engine_steps"], doc["host_profile_ar@1"] = engine_steps(model, plan)
    if torch.cuda.is_available() and plan.device.startswith("cuda"):
        doc["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)
    doc["wall_s"] = round(time.time() - t0, 1)
    return doc


# ------------------------------------------------------------------------------------------ graph runner
# (rows, nodes per row) timed with flex attention (the engine's on CUDA) on the 8B shape: each is a compile of
# its own there; the tree goals' points and the one-node steps they are measured against
FLEX_POINTS = ((1, 1), (1, 16), (8, 1), (8, 16), (32, 1), (32, 8), (64, 1), (64, 4), (1, 4), (8, 4))
# the compiled step's points, most wanted first (the ar goals, then the tree goals): a compile each
COMPILED_POINTS = ((1, 1), (32, 1), (1, 16), (8, 1), (8, 16), (32, 8))
# SDPA pinned to one kernel: a plain step and the tree goals' points
PINNED_POINTS = ((1, 1), (1, 16), (8, 1), (8, 16), (32, 1), (32, 8))
# the engine's greedy steps on CUDA are decided inside the step, keeping the bonus token and logitspec's
# 32 guesses (worker.gpu.choice.decision_top)
ENGINE_DECISION_TOP = 33
# graph_timing's variants, timed in this order: (label, GraphRunner keywords, points; None = every point
# of the plan), the engine's own attention first (its figures are the goals'); on CPU SDPA alone (flex
# attention there is its unfused reference)
TIMING_VARIANTS = (("flex", {"attention": "flex", "decide_top": ENGINE_DECISION_TOP}, FLEX_POINTS),
                   ("sdpa", {"attention": "sdpa"}, None),
                   ("sdpa_efficient", {"attention": "sdpa", "sdpa_backend": "efficient"}, PINNED_POINTS),
                   ("sdpa_cudnn", {"attention": "sdpa", "sdpa_backend": "cudnn"}, PINNED_POINTS))
CPU_TIMING_VARIANTS = (("sdpa", {"attention": "sdpa"}, None),
                       ("sdpa_math", {"attention": "sdpa", "sdpa_backend": "math"}, ((1, 1), (1, 16))))
# compiled_timing's: the engine's attention (flex) compiled; on CPU SDPA compiled at the ar goals' points
COMPILED_VARIANTS = (("flex_compiled", {"attention": "flex", "compile": True,
                                        "decide_top": ENGINE_DECISION_TOP}, COMPILED_POINTS),)
CPU_COMPILED_VARIANTS = (("sdpa_compiled", {"attention": "sdpa", "compile": True}, ((1, 1), (32, 1))),)


def graph_engine_run(model, prompts, plan: Plan, method: str, **runner_kw) -> tuple[list[list[int]], dict]:
    """The whole engine with the graph runner as its model runner: tokens per prompt, and the
    runner's counters."""
    from logitspec.worker.gpu import GraphRunner

    runner = GraphRunner(model, max_rows=plan.batch, max_len=256, **runner_kw)
    config = SpecConfig(method=method, max_batch_size=plan.batch, budget="fixed")
    engine = Engine(model, None, config, runner=runner)
    session = engine.open()
    for p in prompts:
        session.submit(p, Request(max_new_tokens=plan.new_tokens))
    done = sorted(session.drain(), key=lambda r: r.request_id)
    return [r.token_ids for r in done], dict(runner.counters)


def graph_lossless(plan: Plan, deadline: float) -> list[dict]:
    """Greedy through the graph runner: float32 against HF generate, bfloat16 against our bfloat16 ar
    at batch 1 (eager). SDPA on the tiny models; flex attention (off CPU) on copies with head dim 32
    (its kernel's smallest), float32, every step padded to one bucket of 64 nodes (one compile per
    model). Cases not started by ``deadline`` are recorded as skipped."""
    cpu = plan.device.startswith("cpu")
    prompts = repetitive_prompts(plan.prompts, seed=1)
    cases = []
    kinds = [(torch.float32, "sdpa", False)] + ([] if cpu else [
        (torch.bfloat16, "sdpa", False), (torch.float32, "flex", False), (torch.float32, "flex", True)])
    for dtype, attention, compiled in kinds:  # the cheapest first: the time budget cuts from the end
        for family in FAMILIES:
            name = {"family": family, "dtype": str(dtype).split(".")[-1], "attention": attention,
                    "compiled": compiled}
            if time.time() > deadline:
                cases.append({**name, "skipped": True, "equal": 0, "of": 0, "ok": True})
                continue
            extra = {} if attention == "sdpa" else {"head_dim": 32}
            ref_model = tiny_model(family, **extra).to(device=plan.device, dtype=dtype)
            ref = ([hf_generate(ref_model, p, plan.new_tokens) for p in prompts] if dtype == torch.float32
                   else run_engine(ref_model, prompts, plan, "ar", 1)[0])
            kw = {} if attention == "sdpa" else {"node_buckets": (64,), "row_buckets": (plan.batch,),
                                                 "compile": compiled}
            for method in ("ar", "logitspec"):
                case = {**name, "method": method, "batch": plan.batch,
                        "reference": "generate" if dtype == torch.float32 else "ar bfloat16 batch 1"}
                try:
                    model = tiny_model(family, **extra).to(device=plan.device, dtype=dtype)
                    case["merged"] = merge_projections(model)  # as load_model gives it off CPU
                    outs, counters = graph_engine_run(model, prompts, plan, method, attention=attention, **kw)
                    cases.append({**case, "counters": counters, **compare(ref_model, prompts, ref, outs)})
                    del model
                except Exception as e:  # noqa: BLE001 - a failed case, recorded; the others still run
                    traceback.print_exc()
                    cases.append({**case, "error": f"{type(e).__name__}: {str(e)[:300]}", "equal": 0,
                                  "of": len(prompts), "partings": [], "ok": False})
            del ref_model
    return cases


def _graph_step(runner, kv, lengths: list[int], toks: list[int], b: int, n: int):
    """A step of ``b`` rows of ``n`` chained nodes (row r after ``lengths[r]`` cached tokens) as a
    function: the runner's greedy step and its one transfer (the decision made inside the step where
    the runner decides, as the engine's does on CUDA; else the argmax of the output layer run after
    it). Never committed: every call rewrites the same columns."""
    kv.lengths = lengths[:b]
    rows = [StepRow.chain(lengths[r], toks[lengths[r]:lengths[r] + n]) for r in range(b)]

    def step():
        fwd = runner.step(rows, kv, OutputMode.GREEDY)
        return (fwd.decision if fwd.decision is not None else fwd.nodes.argmax).tolist()
    return step


def kernels_per_step(fn, device: torch.device) -> int | None:
    """CUDA kernels one call of ``fn`` launches (a graph's replay: the kernels inside it), by the
    profiler; None off CUDA or where the profiler sees no kernel."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return n or None


def graph_timings(plan: Plan, deadline: float, compiled: bool = False) -> dict:
    """The graph runner's step on the Llama-3-8B shape (random bfloat16 weights; the tiny stand-in on
    CPU): ms per step (the forward, the output layer over the real nodes and the wait for it) at
    ``plan.rows`` x nodes per row (1..32), row r holding context + 16 r tokens, for each of
    :data:`TIMING_VARIANTS` (``compiled``: :data:`COMPILED_VARIANTS`). Per variant every point is built
    (captured; flex or compiled: compiled) first, then timed (the deadline checked before each); the
    kernels of its 1x1 step; then every point again: captures and allocations then."""
    t0 = time.time()
    model, cfg = build_shape("llama3-8b", plan)
    device = torch.device(plan.device)
    nodes = [n for n in plan.nodes if n <= 32]
    lengths = [plan.context + 16 * r for r in range(max(plan.rows))]
    max_len = -(-(lengths[-1] + max(nodes)) // 128) * 128
    toks = [(7 * i + 3) % cfg.vocab_size for i in range(lengths[-1] + max(nodes))]
    doc = {"shape": "llama3-8b" if not plan.tiny else "tiny", "dtype": "bfloat16", "context": plan.context,
           "max_len": max_len, "build_s": round(time.time() - t0, 1), "attention": {}}
    cuda = device.type == "cuda"
    variants = (COMPILED_VARIANTS if cuda else CPU_COMPILED_VARIANTS) if compiled else (
        TIMING_VARIANTS if cuda else CPU_TIMING_VARIANTS)
    for label, kw, points in variants:
        if time.time() > deadline:
            doc["attention"][label] = {"skipped": "out of time before it started"}
            continue
        points = [(b, n) for b in plan.rows for n in nodes] if points is None else list(points)
        try:
            doc["attention"][label] = time_variant(model, plan, kw, points, lengths, toks, max_len, deadline)
        except Exception as e:  # noqa: BLE001 - a kernel this device lacks: recorded, the next variant runs
            doc["attention"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    doc["engine_attention"] = variants[0][0]  # the first variant: what the engine runs on this device
    for label, got in doc["attention"].items():  # the summary's keys (None: not measured)
        ms, x = got.get("ms", {}), got.get("x_plain", {})
        doc["goals" if label == variants[0][0] else f"goals_{label}"] = {
            "step_ms_1x1": ms.get("1x1"), "step_ms_32x1": ms.get("32x1"), "tree16_x_b1": x.get("1x16"),
            "tree16_x_b8": x.get("8x16"), "tree8_x_b32": x.get("32x8"), "tree4_x_b64": x.get("64x4")}
    if cuda:
        doc["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)
    doc["wall_s"] = round(time.time() - t0, 1)
    return doc


def time_variant(model, plan: Plan, kw: dict, points: list, lengths: list[int], toks: list[int],
                 max_len: int, deadline: float) -> dict:
    """One graph runner (``kw``) at ``points`` (rows, nodes): built first, then timed; see
    :func:`graph_timings`."""
    from logitspec.worker.gpu import GraphRunner

    device = torch.device(plan.device)
    cuda = device.type == "cuda"
    most = max(b for b, _ in points)
    runner = GraphRunner(model, max_rows=most, max_len=max_len, row_buckets=tuple(plan.rows),
                         node_buckets=tuple(n for n in plan.nodes if n <= 32), **kw)
    kv = runner.new_batch()
    runner.prefill_slot(toks[:lengths[most - 1]], chunk=2048)  # slot 0; the others copy it (own lengths)
    kv.K[:, 1:most] = kv.K[:, :1]
    kv.V[:, 1:most] = kv.V[:, :1]
    res, first_s, skipped, ready, errors = {}, {}, [], [], {}
    step = functools.partial(_graph_step, runner, kv, lengths, toks)
    for b, n in points:  # every bucket captured (flex, compiled: compiled) before anything is timed
        if time.time() > deadline:
            skipped.append([b, n])
            continue
        t1 = time.time()
        try:
            step(b, n)()
        except Exception as e:  # noqa: BLE001 - this point is recorded; the others still run
            errors[f"{b}x{n}"] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        first_s[f"{b}x{n}"] = round(time.time() - t1, 2)
        ready.append((b, n))
    captured = dict(runner.counters)
    for b, n in ready:
        if time.time() > deadline:
            skipped.append([b, n])
            continue
        res[(b, n)] = fastest(step(b, n), device, reps=max(3, plan.reps))
    kernels = kernels_per_step(step(1, 1), device) if (1, 1) in res else None
    before = dict(runner.counters)
    alloc0 = torch.cuda.memory_stats(device).get("allocation.all.allocated", 0) if cuda else 0
    for b, n in res:  # every shape again: nothing may be captured or allocated for the graphs
        step(b, n)()
    after = dict(runner.counters)
    alloc1 = torch.cuda.memory_stats(device).get("allocation.all.allocated", 0) if cuda else 0
    per_step = round((alloc1 - alloc0) / max(1, len(res)), 1) if cuda else None
    one = {b: res[(b, 1)] for b, _ in res if (b, 1) in res}
    counted = ("graphs", "captures", "allocations", "compiles")
    return {
        "runner": runner.kind, "ms": {f"{b}x{n}": round(s * 1e3, 3) for (b, n), s in res.items()},
        "x_plain": {f"{b}x{n}": round(s / one[b], 3) for (b, n), s in res.items() if b in one},
        "first_call_s": first_s, "skipped": skipped, "errors": errors, "counters": after,
        "kernels_per_step": kernels,
        "timed": {k: after[k] - captured[k] for k in counted},
        "repeat": {**{k: after[k] - before[k] for k in counted}, "cuda_allocations_per_step": per_step},
        "kv_gib": round(kv.bytes / 2 ** 30, 2)}


# ------------------------------------------------------------------------------------------ main
def environment(plan: Plan) -> dict:
    import transformers

    heavy = sorted(m for m in ("ray", "deepspeed") if m in sys.modules)
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "device": plan.device, "plan": asdict(plan),
           "ray_or_deepspeed_imported": heavy}
    if plan.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(plan.device))
    return env


# the graph runner's check, in this order (the default), by what the figures are worth: graph-mode lossless,
# the engine's own step (its goals: ms at 1 and 32 rows, sampled over greedy), the tree curve (trees' cost
# over one node), the recorded methods' acceptance replayed on the 8B shape, the long prefill, HF's graph
# step (the reference), and last the compiled step (a compile per point: minutes on an 8B shape)
GRAPH_PARTS = ("graph_lossless", "ar_steps", "graph_timing", "replay", "prefill_8k", "hf_graph",
               "compiled_timing")
EAGER_PARTS = ("lossless", "device_paths")  # the eager engine's check (passed on the H200), with the curves
# a part's share of the time left when it starts (the rest: the parts after it); every part skips what
# it cannot start by its share's end (graph_timing: its variants in order, each's points in order)
SHARE = {"graph_lossless": 0.15, "ar_steps": 0.3, "graph_timing": 0.35, "replay": 0.4, "prefill_8k": 0.2,
         "hf_graph": 0.3, "compiled_timing": 1.0}


def part_names(plan: Plan, asked: str | None = None) -> list[str]:
    """The parts ``--parts`` names: a comma-separated list, "all", or (default) the graph runner's."""
    every = [*EAGER_PARTS, *GRAPH_PARTS] + [f"curve_{n}" for n in plan.shapes]
    if asked == "all":
        return every
    return asked.split(",") if asked else list(GRAPH_PARTS)


def run_part(name: str, plan: Plan, deadline: float) -> dict:
    deadline = time.time() + SHARE.get(name, 1.0) * (deadline - time.time())
    if name == "lossless":
        return {"cases": [c for f in FAMILIES for c in lossless_family(f, plan)]}
    if name == "device_paths":
        return {"host_waits": host_waits(plan), "sampling": device_sampling(plan)}
    if name == "graph_lossless":
        cases = graph_lossless(plan, deadline)
        return {"ok": all(c["ok"] for c in cases), "cases": cases}
    if name in ("graph_timing", "compiled_timing"):
        return graph_timings(plan, deadline, compiled=name == "compiled_timing")
    if name == "replay":
        return replayed(plan, deadline)
    if name in ("hf_graph", "ar_steps", "prefill_8k"):
        return shape_steps(name, plan, deadline)
    return curve_for(name.removeprefix("curve_"), plan, deadline)


def shape_steps(name: str, plan: Plan, deadline: float) -> dict:
    """One decode-step part on the Llama-3-8B shape (random bfloat16 weights; the tiny stand-in on
    CPU): the HF static-cache graph step, our ar step, or the long prefill (gpu_check_steps)."""
    t0 = time.time()
    merged = name != "hf_graph"  # the HF reference step runs stock HF modules
    model, _ = build_shape("llama3-8b", plan, merged=merged)
    doc = {"shape": "tiny" if plan.tiny else "llama3-8b", "dtype": "bfloat16", "merged": merged,
           "build_s": round(time.time() - t0, 1)}
    if name == "hf_graph":
        doc.update(hf_graph_steps(model, plan.hf_rows, plan.prompt_len, max(3, plan.reps), deadline))
    elif name == "ar_steps":
        rows = sorted(plan.rows, key=lambda b: (b not in (1, 32), b))  # the summary's 1 and 32 rows first
        doc.update(ar_steps(model, rows, plan.prompt_len, plan.ar_tokens, deadline))
    else:
        doc.update(prefill_timings(model, plan.prefill_tokens, plan.prefill_chunk, max(2, plan.reps),
                                   deadline))
    if plan.device.startswith("cuda"):
        doc["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)
    doc["wall_s"] = round(time.time() - t0, 1)
    return doc


def replayed(plan: Plan, deadline: float, traces: pathlib.Path = TRACES) -> dict:
    """Replayed acceptance (docs/gpu.md): the recorded traces' trees and accepted lengths through the
    whole engine on the Llama-3-8B shape (the graph runner on CUDA), a row per recorded method and
    ``ar``, at each of ``plan.replay_rows`` it can start by ``deadline`` (the others: ``skipped``).
    ``replay``: per trace set, ``"<method>@<rows>"`` -> ms per token, speed-up over ``ar``, MAT."""
    from logitspec.bench.replay import replay, traced_methods
    from logitspec.bench.trace import load_traces

    t0 = time.time()
    model, _ = build_shape("llama3-8b", plan)
    loaded = load_traces(traces)
    methods = traced_methods(loaded)
    doc = {"shape": "tiny" if plan.tiny else "llama3-8b", "dtype": "bfloat16", "methods": methods,
           "prompt_tokens_cut": plan.replay_prompt_tokens, "replay": {}, "traces": {}, "skipped": []}
    for rows in plan.replay_rows:
        if time.time() > deadline:
            doc["skipped"].append(rows)
            continue
        got = replay(model, loaded, methods, (rows,), max_prompt_tokens=plan.replay_prompt_tokens)
        doc.update(label=got["label"], model=got["model"])
        for name, t in got["traces"].items():
            doc["traces"].setdefault(name, {"recorded": t["recorded"], "results": {}})["results"].update(
                t["results"])
            doc["replay"].setdefault(name, {}).update(
                {k: {f: (round(r[f], 3) if r[f] is not None else None)
                     for f in ("ms_per_token", "x_ar", "x_ar_e2e", "mat")} for k, r in t["results"].items()})
    if plan.device.startswith("cuda"):
        doc["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)
    doc["wall_s"] = round(time.time() - t0, 1)
    return doc


def part(name: str, plan: Plan, deadline: float, out: pathlib.Path) -> dict:
    """Run one part, write its JSON; its outcome (an exception is recorded, not raised)."""
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            doc = run_part(name, plan, deadline)
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
        return {"wall_s": round(time.perf_counter() - t0, 1), "error": None}
    except Exception as e:  # noqa: BLE001 - one failing part must not lose the others' results
        traceback.print_exc()
        return {"wall_s": round(time.perf_counter() - t0, 1), "error": repr(e)[:2000]}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            try:
                torch.cuda.empty_cache()
            except RuntimeError:  # after a CUDA fault every call raises it again; it is recorded above
                pass


def part_in_process(name: str, args, start: float) -> dict:
    """One part in a process of its own: a CUDA error is sticky (the process's every later call
    fails), so one part's fault must not take the others down. The lossless part runs with
    ``CUDA_LAUNCH_BLOCKING=1``, so a fault's traceback names the call that made it."""
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--out", args.out, "--device", args.device, "--parts", name,
           "--start", repr(start), "--budget-s", repr(args.budget_s)] + (["--tiny"] if args.tiny else [])
    env = {**os.environ, **({"CUDA_LAUNCH_BLOCKING": "1"} if name == "lossless" else {})}
    rc = subprocess.run(cmd, env=env).returncode
    done = pathlib.Path(args.out, f"{name}.part.json")
    if done.exists():  # read and removed at once: what comes back from the device is 8 files at most
        outcome = json.loads(done.read_text())
        done.unlink()
        return outcome
    return {"wall_s": round(time.perf_counter() - t0, 1),
            "error": f"its process exited with {rc} before recording"}


def main(argv=None) -> int:
    from logitspec.versions import UnsupportedVersion, check_versions

    try:  # an untested transformers may ignore the cache argument: every figure would be wrong
        check_versions()
    except UnsupportedVersion as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes and few prompts (CI, CPU)")
    ap.add_argument("--budget-s", type=float, default=320.0,
                    help="start no curve row, engine run or timed point past this")
    ap.add_argument("--parts", help="comma-separated parts to run, or 'all' (default: the graph runner's, "
                                    f"{','.join(GRAPH_PARTS)}; off CPU each in its own process)")
    ap.add_argument("--isolate", action="store_true", help="each part in its own process (the default "
                                                           "off CPU)")
    ap.add_argument("--start", type=float, help=argparse.SUPPRESS)  # the whole check's start (epoch seconds)
    args = ap.parse_args(argv)
    plan, start = plan_for(args), args.start or time.time()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    names = part_names(plan, args.parts)
    # a child of the run below: record the outcome for the parent
    if args.start is not None and len(names) == 1:
        outcome = part(names[0], plan, start + args.budget_s, out)
        (out / f"{names[0]}.part.json").write_text(json.dumps(outcome))
        return 0 if outcome["error"] is None else 1
    isolate = args.isolate or not plan.device.startswith("cpu")
    summary = {"environment": environment(plan), "parts": {}}
    for name in names:
        summary["parts"][name] = (part_in_process(name, args, start) if isolate
                                  else part(name, plan, start + args.budget_s, out))
        write_summary(summary, out, start)  # what is done so far, should the time limit stop the check
    for f in out.glob("*.part.json"):
        f.unlink()
    return summarise(summary, out, start)


if __name__ == "__main__":
    sys.exit(main())

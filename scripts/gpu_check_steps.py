"""The decode-step parts of the device check (docs/gpu.md, "The device check"), on one model
(the 8B shape with random weights on the GPU, the tiny stand-in on CPU):

- :func:`hf_graph_steps`: the reference, HF's own forward over a ``transformers.StaticCache``, one
  greedy decoding step (forward, argmax, the next step's token and position written in place)
  captured once in a CUDA graph and replayed (uncaptured on CPU);
- :func:`ar_steps`: our engine's ``ar`` step through the graph runner, greedy and sampled, at each
  row count: a warm-up run, then a timed run of the same shapes (its captures counted: 0 expected)
  and, on CUDA, its host waits by code location;
- :func:`prefill_timings`: a long prompt prefilled the engine's way (causal chunks through the
  eager path, copied into a slot) and straight into a slot in chunks.

Only public transformers and torch APIs; the engine through its public names.
"""
from __future__ import annotations

import contextlib
import pathlib
import statistics
import time
import warnings
from collections import Counter

import torch

from logitspec import Engine, SpecConfig
from logitspec.device import fastest
from logitspec.engine.request import Request
from logitspec.worker.gpu import GraphRunner
from logitspec.worker.gpu.choice import decision_top

SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # the synthetic-data setting of the sampling goal
GREEDY = {"temperature": 0.0}


@contextlib.contextmanager
def count_host_waits(device: torch.device):
    """A Counter of the host's waits for the device inside the block, by code location (CUDA's sync
    debug mode); None where the device is not CUDA (nothing to count)."""
    if device.type != "cuda":
        yield None
        return
    where = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield where
        finally:
            torch.cuda.set_sync_debug_mode("default")
            where.update(f"{pathlib.Path(w.filename).name}:{w.lineno}" for w in caught
                         if "synchroniz" in str(w.message))


def token_prompts(rows: int, length: int, vocab: int) -> list[list[int]]:
    """``rows`` prompts of ``length`` token ids below ``vocab``, each row its own."""
    return [[(31 * i + 7 * r + 3) % vocab for i in range(length)] for r in range(rows)]


# ------------------------------------------------------------------------------------------ HF reference
def hf_step(model, rows: int, prompt_len: int, room: int = 64):
    """HF's greedy decoding step over a StaticCache of ``rows`` prompts of ``prompt_len`` tokens,
    prefilled: a function of no arguments that runs one step in place (forward over the next
    token, argmax, the token and position advanced: every call decodes one more token), and the
    tokens [rows, 1] it writes."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + room)
    ids = torch.tensor(token_prompts(rows, prompt_len, model.config.vocab_size), device=device)
    pos = torch.arange(prompt_len, device=device).expand(rows, -1)
    logits = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1].argmax(-1, keepdim=True)  # [rows, 1]: the static input of every step
    position = torch.full((rows, 1), prompt_len, dtype=torch.long, device=device)

    def step():
        out = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits
        token.copy_(out[:, -1].argmax(-1, keepdim=True))
        position.add_(1)

    return step, token


def capture(fn, warmup: int = 3):
    """``fn`` captured in a CUDA graph (after ``warmup`` calls on a side stream); its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def hf_graph_steps(model, rows, prompt_len: int, reps: int, deadline: float) -> dict:
    """ms per HF reference step (fastest of ``reps`` replays, each waited for) at each row count;
    captured on CUDA, the plain step elsewhere. Row counts not started by ``deadline`` are skipped."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    doc = {"captured": cuda, "prompt_len": prompt_len, "ms": {}, "first_s": {}, "skipped": []}
    for b in rows:
        if time.time() > deadline:
            doc["skipped"].append(b)
            continue
        t0 = time.time()
        try:
            step, _ = hf_step(model, b, prompt_len, room=8 + 2 * reps)
            fn = capture(step) if cuda else step
            doc["first_s"][str(b)] = round(time.time() - t0, 2)  # prefill, warm-up and capture
            doc["ms"][str(b)] = round(fastest(fn, device, reps=reps) * 1e3, 3)
            del step, fn
        except Exception as e:  # noqa: BLE001 - recorded; the next row count still runs
            doc.setdefault("errors", {})[str(b)] = f"{type(e).__name__}: {str(e)[:300]}"
        if cuda:
            torch.cuda.empty_cache()
    return doc


# ------------------------------------------------------------------------------------------ our ar step
def decode_steps(engine: Engine, prompts, request: Request) -> tuple[list[float], list, Counter | None]:
    """Run ``prompts`` through a session of ``engine``: the wall time of each step in which every
    row decoded and nothing waited for a prefill or a slot (the steady decode step), the results,
    and the host's waits in the steady steps by code location (None off CUDA)."""
    session = engine.open()
    for p in prompts:
        session.submit(p, request)
    times, results, waits = [], [], None
    while session.busy:
        steady = len(session.active) == len(prompts) and not (session.pending or session.ready
                                                                or session.prefilling)
        with count_host_waits(engine.runner.device) if steady else contextlib.nullcontext() as where:
            t0 = time.perf_counter()
            results += session.step()
            dt = time.perf_counter() - t0
        if steady:
            times.append(dt)
            waits = None if where is None else (waits or Counter()) + where
    return times, results, waits


def ar_case(engine: Engine, runner: GraphRunner, prompts, request: Request) -> dict:
    """One row count and sampling setting: a warm-up run (captures its buckets), then the same run
    timed; ms per steady step, the split of the engine's step, what the timed run captured, and on
    CUDA the host's waits per steady step."""
    decode_steps(engine, prompts, request)
    before = dict(runner.counters)
    times, results, waits = decode_steps(engine, prompts, request)
    after = dict(runner.counters)
    s = results[0].stats  # every row is charged the whole step
    n = max(1, s["steps"] - 1)
    doc = {"ms": round(statistics.median(times) * 1e3, 3), "ms_min": round(min(times) * 1e3, 3),
           "steady_steps": len(times),
           "split_ms": {k[:-2]: round(s[k] / n * 1e3, 3)
                        for k in ("draft_s", "pack_s", "forward_s", "verify_s", "commit_s")},
           "timed_run": {k: after[k] - before[k] for k in ("graphs", "captures", "allocations", "replays")}}
    if waits is not None:  # in the steady steps
        total = sum(waits.values())
        doc["host_waits"] = {"total": total, "per_step": round(total / len(times), 2),
                             "by_location": dict(waits.most_common())}
    return doc


def ar_steps(model, rows, prompt_len: int, new_tokens: int, deadline: float) -> dict:
    """Our engine's ``ar`` step at each row count, greedy and sampled (T 0.8, top-p 0.95), through
    the graph runner the engine makes on this device (flex attention on CUDA, SDPA elsewhere:
    ``runner``, ``greedy``, ``sampled``), then through one attending the other way (``variant``).
    Each runner holds slots for the most rows and builds the row counts' buckets at start-up, as the
    engine does. A case not started by ``deadline`` is skipped; one that raises is recorded
    (``{"error": ...}``) and the next runs."""
    cuda = next(model.parameters()).device.type == "cuda"
    engine_attention, other = ("flex", "sdpa") if cuda else ("sdpa", "flex")
    doc = ar_runner_steps(model, rows, prompt_len, new_tokens, deadline, engine_attention)
    doc["variant"] = ar_runner_steps(model, rows, prompt_len, new_tokens, deadline, other)
    return doc


def ar_runner_steps(model, rows, prompt_len: int, new_tokens: int, deadline: float, attention: str) -> dict:
    """:func:`ar_steps` through one graph runner attending with ``attention``."""
    most = max(rows)
    max_len = -(-(prompt_len + new_tokens + 64) // 128) * 128  # + the largest node bucket
    doc = {"attention": attention, "prompt_len": prompt_len, "new_tokens": new_tokens, "max_len": max_len,
           "greedy": {}, "sampled": {}, "skipped": []}
    if time.time() > deadline:
        doc["skipped"] = [[b, mode] for b in rows for mode in ("greedy", "sampled")]
        return doc
    # greedy steps decided inside the step, as the engine's ar runner on CUDA does (no guesses kept)
    runner = GraphRunner(model, max_rows=most, max_len=max_len, attention=attention,
                         row_buckets=tuple(sorted(rows)), decide_top=decision_top(SpecConfig(method="ar")))
    t0 = time.time()
    with torch.inference_mode():
        runner.capture_all(most, 1)
    doc["build_s"] = round(time.time() - t0, 1)
    for b in rows:
        prompts = token_prompts(b, prompt_len, model.config.vocab_size)
        for mode, setting in (("greedy", GREEDY), ("sampled", SAMPLED)):
            if time.time() > deadline:
                doc["skipped"].append([b, mode])
                continue
            try:
                engine = Engine(model, None, SpecConfig(method="ar", max_batch_size=b), runner=runner)
                request = Request.make(max_new_tokens=new_tokens, seed=1, **setting)
                doc[mode][str(b)] = ar_case(engine, runner, prompts, request)
            except Exception as e:  # noqa: BLE001 - recorded; the other cases still run
                doc[mode][str(b)] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    doc["runner"] = runner.kind
    doc["counters"] = dict(runner.counters)
    doc["kv_gib"] = round(runner.kv.bytes / 2 ** 30, 2)
    return doc


# ------------------------------------------------------------------------------------------ prefill
def prefill_timings(model, tokens: int, chunk: int, reps: int, deadline: float) -> dict:
    """Seconds to prefill one prompt of ``tokens`` tokens (fastest of ``reps`` after a warm-up): the
    engine's way (causal chunks of ``chunk`` through the eager path, then the row copied into a
    slot of the graph runner), and straight into a slot in chunks of ``chunk`` and of the whole
    prompt; a way not started by ``deadline`` is None (listed in ``skipped``)."""
    device = next(model.parameters()).device
    runner = GraphRunner(model, max_rows=1, max_len=-(-(tokens + 64) // 128) * 128)
    prompt = token_prompts(1, tokens, model.config.vocab_size)[0]

    def engine_way():
        row, _ = runner.prefill(prompt, chunk)
        runner.new_batch(1).add_rows([(row, 0, 1)])

    def into_slot(size):
        runner.new_batch(1)
        runner.prefill_slot(prompt, size)

    doc = {"tokens": tokens, "chunk": chunk, "skipped": []}
    for key, fn in (("engine_s", engine_way), ("slot_chunked_s", lambda: into_slot(chunk)),
                    ("slot_whole_s", lambda: into_slot(tokens))):
        if time.time() > deadline:
            doc[key] = None
            doc["skipped"].append(key)
            continue
        try:
            doc[key] = round(fastest(fn, device, reps=reps), 4)
        except Exception as e:  # noqa: BLE001 - recorded; the other ways still run
            doc[key] = None
            doc[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return doc

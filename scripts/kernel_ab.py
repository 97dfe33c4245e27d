"""The CPU kernels on and off, in one process: per-step decode time and tokens/s of one engine over
the throughput harness's prompts.

    .venv/bin/python scripts/kernel_ab.py --batch-size 24 --method ar [--kernels rms_norm]
    .venv/bin/python scripts/kernel_ab.py --long out/longbench_8k/lcc.jsonl --tokens 8000 --kernels rms_norm

``--kernels`` names the kernels to switch (default all): ``attention`` (the decode attention
kernel; "off": SDPA, ``decode_attention.applies`` answers False), ``screen`` (the compiled
candidate search; "off": torch's amax / compare / nonzero) and ``rms_norm`` (the fused RMS norm;
"off": transformers' forward). Rounds alternate the order. Decode ms per step is (a 64-token run
- a 1-token run) / (steps - 1). ``--long FILE``: instead, one prompt at batch 1, the first row of a
LongBench-format .jsonl file (``context`` + ``input``, cut to ``--tokens``): its prefill seconds and
decode ms per step (40 new tokens).
"""
import argparse
import json
import time

import logitspec.attention as attention
import logitspec.head as head
import logitspec.kernels.rms_norm as rms_norm
from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns, warmup_question
from logitspec.bench.throughput import batch_prompts
from logitspec.models import load_model

# per kernel: (module, attribute, its replacement when off)
SWITCHES = {
    "attention": (attention.decode_attention, "applies", lambda *a: False),
    "screen": (head, "_candidates", head.torch_candidates),
    "rms_norm": (rms_norm, "_applies", lambda *a: False),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--method", default="ar")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels", default=",".join(SWITCHES), help=f"comma-separated, of {sorted(SWITCHES)}")
    ap.add_argument("--long", help="a LongBench-format .jsonl file: time its first row's prompt at batch 1")
    ap.add_argument("--tokens", type=int, default=8000, help="with --long: the prompt cut to this many tokens")
    args = ap.parse_args()
    chosen = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(chosen) - set(SWITCHES))
    if unknown:
        ap.error(f"unknown kernels {unknown}; choose from {sorted(SWITCHES)}")
    model, tok = load_model("default")
    batch = 1 if args.long else args.batch_size
    eng = Engine(model, tok, SpecConfig(method=args.method, max_batch_size=batch))
    eng.generate([warmup_question(tok, model.config.get_text_config(decoder=True).vocab_size).turns[0]],
                 max_new_tokens=8)
    if args.long:
        with open(args.long) as f:
            row = json.loads(f.readline())
        ids = tok(row.get("context", "") + "\n" + row.get("input", "")).input_ids[:args.tokens]
        measure, what = _long_prompt(eng, ids), ("prefill s", "decode ms/step")
    else:
        prompts = batch_prompts(first_turns(None, 1, max_chars=1500), batch)
        measure, what = _batch(eng, prompts), ("decode ms/step", "tokens/s")
    real = {k: getattr(SWITCHES[k][0], SWITCHES[k][1]) for k in chosen}

    def switch(on: bool) -> None:
        for k in chosen:
            mod, name, off = SWITCHES[k]
            setattr(mod, name, real[k] if on else off)

    res, outs = {True: [], False: []}, {}
    for r in range(args.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            switch(on)
            a, b, outs[on] = measure()
            res[on].append((a, b))
    switch(True)
    for on in (True, False):
        print(f"{'on ' if on else 'off'} ({','.join(chosen)}) {what[0]}", [round(a, 2) for a, _ in res[on]],
              what[1], [round(b, 1) for _, b in res[on]])
    print("same outputs:", outs[True] == outs[False])


def _batch(eng, prompts):
    """A measurement over a batch: (decode ms/step, tokens/s, outputs)."""
    def measure():
        first = eng.run(prompts, max_new_tokens=1).stats["wall_s"]
        run = eng.run(prompts, max_new_tokens=64)
        s = run.stats
        return (s["wall_s"] - first) / (s["batch_steps"] - 1) * 1e3, s["tokens_per_s"], [x.token_ids for x in run.results]
    return measure


def _long_prompt(eng, ids):
    """A measurement of one long prompt: (prefill s, decode ms/step, its output)."""
    def measure():
        session = eng.open(max_new_tokens=40)
        session.submit(ids)
        t = time.perf_counter()
        session.step()  # the prefill and the first token
        pre = time.perf_counter() - t
        t = time.perf_counter()
        r = session.drain()[0]
        return pre, (time.perf_counter() - t) / (len(r.token_ids) - 1) * 1e3, r.token_ids
    return measure


if __name__ == "__main__":
    main()

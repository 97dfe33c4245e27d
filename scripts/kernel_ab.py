"""The decode attention kernel and the compiled screen candidate search on and off, in one process:
per-step decode time and tokens/s of one engine over the throughput harness's prompts.

    .venv/bin/python scripts/kernel_ab.py --batch-size 24 --method ar

"off" routes attention back to SDPA (``decode_attention.applies`` answers False) and the candidate
search to torch's amax / compare / nonzero; rounds alternate the order. Decode ms per step is
(a 64-token run - a 1-token run) / (steps - 1).
"""
import argparse

import logitspec.attention as attention
import logitspec.head as head
from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns, warmup_question
from logitspec.bench.throughput import batch_prompts
from logitspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--method", default="ar")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model, tok = load_model("default")
    prompts = batch_prompts(first_turns(None, 1, max_chars=1500), args.batch_size)
    eng = Engine(model, tok, SpecConfig(method=args.method, max_batch_size=args.batch_size))
    eng.generate([warmup_question(tok, model.config.get_text_config(decoder=True).vocab_size).turns[0]],
                 max_new_tokens=8)
    real = attention.decode_attention.applies, head._candidates
    res, outs = {True: [], False: []}, {}
    for r in range(args.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            attention.decode_attention.applies = real[0] if on else (lambda *a: False)
            head._candidates = real[1] if on else head.torch_candidates
            first = eng.run(prompts, max_new_tokens=1).stats["wall_s"]
            run = eng.run(prompts, max_new_tokens=64)
            s = run.stats
            res[on].append(((s["wall_s"] - first) / (s["batch_steps"] - 1) * 1e3, s["tokens_per_s"]))
            outs[on] = [x.token_ids for x in run.results]
    attention.decode_attention.applies, head._candidates = real
    for on in (True, False):
        print("kernels" if on else "torch  ", "decode ms/step", [round(a, 1) for a, _ in res[on]],
              "tokens/s", [round(b, 1) for _, b in res[on]])
    print("same outputs:", outs[True] == outs[False])


if __name__ == "__main__":
    main()

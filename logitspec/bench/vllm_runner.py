"""Run vLLM on given prompts at several batch sizes and write tokens/s as JSON (a standalone script).

Executed by :mod:`logitspec.bench.vllm_baseline` with the python of vLLM's own virtual environment,
so it imports only the standard library at module level (and vLLM inside :func:`main`); it never
imports ``logitspec``. Usage::

    python vllm_runner.py REQUEST.json RESULT.json

REQUEST: ``{"model": dir, "method": "plain"|"ngram"|"suffix", "prompts": {"<b>": [[ids]]} (the prompts
batch size b runs), "max_new_tokens": n, "rounds": r, "dtype": "float32", "spec_tokens": k,
"max_model_len": m, "warmup": [ids], "slots": bool}``. Prefix caching is off: our engines have none,
and the repeated prompts of a batch would otherwise skip their prefill.
RESULT (:func:`measure`'s record): ``{"method", "engine_init_s", "runs": [{"batch_size", "round",
"tokens", "wall_s", "tokens_per_s", "token_ids"}]}``. Batch size b runs the prompts in consecutive
groups of b, each group as one ``generate`` call (all of a group's rows decode together); with
``slots`` all of them in one call, which vLLM's scheduler runs b at a time (``max_num_seqs``, the
largest batch size of the request: send one batch size per request), a finished row's slot taken
by the next prompt, as in a job.
"""
from __future__ import annotations

import json
import sys
import time

SPECULATIVE = {  # vLLM speculative_config per method (k: drafted tokens per step)
    "plain": None,
    "ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                        "prompt_lookup_min": 1},
    "suffix": lambda k: {"method": "suffix", "num_speculative_tokens": k},
}


def measure(generate, prompts: dict, rounds: int, clock=time.perf_counter, slots: bool = False) -> list[dict]:
    """Per round and batch size b (``prompts``: b -> its prompts): ``generate(group)`` (a list of
    prompts -> one list of new token ids per prompt) over consecutive groups of b prompts (``slots``:
    all prompts as one group; the engine's own limit keeps b running); tokens, wall time, tokens/s
    and the outputs."""
    runs = []
    for r in range(rounds):
        for key, batch in prompts.items():
            b = int(key)
            group = len(batch) if slots else b
            outputs = []
            t0 = clock()
            for i in range(0, len(batch), group):
                outputs += generate(batch[i:i + group])
            wall = clock() - t0
            tokens = sum(len(o) for o in outputs)
            runs.append({"batch_size": b, "round": r, "tokens": tokens, "wall_s": wall,
                         "tokens_per_s": tokens / wall if wall > 0 else 0.0, "token_ids": outputs})
    return runs


def vllm_generate(llm, sampling):
    """A ``generate`` for :func:`measure`: token-id prompts through ``llm``, greedy, new ids per prompt."""
    def generate(group):
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in group], sampling, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate


def main(argv) -> int:
    req_path, out_path = argv
    with open(req_path, encoding="utf-8") as f:
        req = json.load(f)
    from vllm import LLM, SamplingParams  # only in vLLM's environment

    spec = SPECULATIVE[req["method"]]
    t0 = time.perf_counter()
    llm = LLM(model=req["model"], dtype=req.get("dtype", "float32"), seed=0, enable_prefix_caching=False,
              max_num_seqs=max(int(b) for b in req["prompts"]), max_model_len=req.get("max_model_len", 2048),
              speculative_config=spec(req.get("spec_tokens", 5)) if spec else None)
    init_s = time.perf_counter() - t0
    generate = vllm_generate(llm, SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"]))
    generate([req.get("warmup") or next(iter(req["prompts"].values()))[0]])  # warm-up, not measured
    write_record(out_path, req["method"], init_s, measure(generate, req["prompts"], req.get("rounds", 1),
                                                                  slots=bool(req.get("slots", False))))
    return 0


def write_record(path, method: str, init_s: float, runs: list[dict]) -> None:
    """The result file: the method, the engine's start-up seconds and :func:`measure`'s runs."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"method": method, "engine_init_s": init_s, "runs": runs}, f)


if __name__ == "__main__":  # vLLM spawns worker processes: nothing may run on their import
    sys.exit(main(sys.argv[1:]))

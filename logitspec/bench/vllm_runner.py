"""Serve vLLM generation rounds to a parent process (a standalone script run in vLLM's environment).

Executed by :mod:`logitspec.bench.vllm_baseline` with the python of vLLM's own virtual environment,
so it imports only the standard library at module level (and vLLM inside :func:`main`); it never
imports ``logitspec``. Usage::

    python vllm_runner.py REQUEST.json

REQUEST: ``{"model": dir, "method": "plain"|"ngram"|"suffix", "dtype": "float32", "max_num_seqs": b,
"max_model_len": m, "spec_tokens": k, "warmup": [ids]}``. The runner starts the engine, generates
the warm-up prompt (not measured) and then stays resident: each line on stdin is a round,
``{"batch_size": b, "prompts": [[ids]], "slots": bool, "reply": path}``, measured by :func:`measure`
and written as JSON to ``reply``; an empty line or end of input ends it. Each reply (and the start-up
record ``{"engine_init_s": s}`` for the request's ``reply``) is announced by a line ``MARK path`` on
stdout, where vLLM's own logs also go. Resident, its rounds can alternate with the parent's own so
that a machine whose speed drifts slows both alike. Prefix caching is off: our engines have none,
and the repeated prompts of a batch would otherwise skip their prefill.
"""
from __future__ import annotations

import json
import sys
import time

MARK = "@@logitspec-vllm-reply@@"
SPECULATIVE = {  # vLLM speculative_config per method (k: drafted tokens per step)
    "plain": None,
    "ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                        "prompt_lookup_min": 1},
    "suffix": lambda k: {"method": "suffix", "num_speculative_tokens": k},
}


def measure(generate, batch_size: int, prompts: list, clock=time.perf_counter, slots: bool = False) -> dict:
    """One round at batch size b: ``generate(group)`` (a list of prompts -> one list of new token ids
    per prompt) over consecutive groups of b ``prompts`` (``slots``: all of them as one group, the
    engine's own limit keeping b running, a finished row's slot taken by the next prompt); tokens,
    wall time, tokens/s and the outputs."""
    group = len(prompts) if slots else batch_size
    outputs = []
    t0 = clock()
    for i in range(0, len(prompts), group):
        outputs += generate(prompts[i:i + group])
    wall = clock() - t0
    tokens = sum(len(o) for o in outputs)
    return {"batch_size": batch_size, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0, "token_ids": outputs}


def serve(generate, commands, announce, clock=time.perf_counter) -> int:
    """Answer each round of ``commands`` (lines, see the module docstring) until an empty line or
    their end: :func:`measure`'s record written to the round's ``reply`` and ``announce(path)``
    called. Returns the number of rounds served."""
    served = 0
    for line in commands:
        if not line.strip():
            break
        cmd = json.loads(line)
        write_json(cmd["reply"], measure(generate, int(cmd["batch_size"]), cmd["prompts"], clock,
                                         bool(cmd.get("slots", False))))
        announce(cmd["reply"])
        served += 1
    return served


def vllm_generate(llm, sampling):
    """A ``generate`` for :func:`measure`: token-id prompts through ``llm``, new ids per prompt."""
    def generate(group):
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in group], sampling, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate


def announce(path: str) -> None:
    """Tell the parent that ``path`` is written: one line of its own on stdout."""
    sys.stdout.write(f"\n{MARK} {path}\n")
    sys.stdout.flush()


def main(argv) -> int:
    (req_path,) = argv
    with open(req_path, encoding="utf-8") as f:
        req = json.load(f)
    from vllm import LLM, SamplingParams  # only in vLLM's environment

    spec = SPECULATIVE[req["method"]]
    t0 = time.perf_counter()
    llm = LLM(model=req["model"], dtype=req.get("dtype", "float32"), seed=0, enable_prefix_caching=False,
              max_num_seqs=int(req["max_num_seqs"]), max_model_len=req.get("max_model_len", 2048),
              speculative_config=spec(req.get("spec_tokens", 5)) if spec else None)
    init_s = time.perf_counter() - t0
    generate = vllm_generate(llm, SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"]))
    generate([req["warmup"]])  # warm-up, not measured
    write_json(req["reply"], {"method": req["method"], "engine_init_s": init_s})
    announce(req["reply"])
    serve(generate, sys.stdin, announce)
    return 0


def write_json(path, record) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f)


if __name__ == "__main__":  # vLLM spawns worker processes: nothing may run on their import
    sys.exit(main(sys.argv[1:]))

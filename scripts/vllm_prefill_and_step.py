"""vLLM's prefill seconds and decode ms per step on the throughput prompts at 6 and 24 rows (float32
or REQ.json's "dtype", prefix caching off); run with vLLM's own python and environment
(``logitspec.bench.vllm_baseline.runner_env`` gives it), e.g. ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 VLLM_CPU_OMP_THREADS_BIND=0-1
VLLM_CPU_KVCACHE_SPACE=4 ~/.cache/logitspec/vllm-venv/bin/python scripts/vllm_prefill_and_step.py REQ.json``
where REQ.json is ``{"model": dir, "prompts": {"6": [[ids]], "24": [[ids]]}}`` (the throughput
harness's token ids: ``logitspec.bench.throughput.batch_prompts`` of the first turns). Imports only
vLLM and the standard library. Same split as ``scripts/prefill_and_step.py``: a 1-token run, then 64.
"""
import json
import sys
import time


def main() -> None:
    req = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    llm = LLM(model=req["model"], dtype=req.get("dtype", "float32"), seed=0, enable_prefix_caching=False,
              max_num_seqs=max(int(b) for b in req["prompts"]), max_model_len=2048)

    def run(group, n):
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in group],
                            SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
        return time.perf_counter() - t, [len(o.outputs[0].token_ids) for o in outs]

    run(next(iter(req["prompts"].values()))[:1], 8)  # warm-up
    for _ in range(2):
        for b, rows in req["prompts"].items():
            first, _ = run(rows, 1)
            wall, lens = run(rows, 64)
            print(json.dumps({"rows": int(b), "prefill_s": round(first, 3), "wall_s": round(wall, 3),
                              "tokens": sum(lens), "step_ms": round((wall - first) / (max(lens) - 1) * 1e3, 1)}),
                  flush=True)


if __name__ == "__main__":
    main()

"""One greedy screen call with the int8 pass against the other passes, on Gemma 3's real hidden states.

    .venv/bin/python scripts/int8_screen_calls.py [--rows 1,6,8,12,16]

Decodes Spec-Bench's first turns (one per task, 24 tokens, ``ar`` at 6 rows) with a hook on the
final norm, keeping each forward's last two states (48 states). For each row count: candidates a
row left by the int8 bound, then the fastest of 15 calls of each piece: the pass (activation
rounding and the kernel), the candidate search, the float32 rescoring, the whole int8 call, the
whole call of the other passes, and the bfloat16 and fbgemm passes alone.
"""
import argparse
import time

import torch

from logitspec import Engine, SpecConfig, head
from logitspec.bench.questions import first_turns
from logitspec.models import load_model


def fastest_ms(f, n: int = 15) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,6,8,12,16")
    args = ap.parse_args()
    with torch.inference_mode():
        model, tok = load_model("default")
        engine = Engine(model, tok, SpecConfig(method="ar", max_batch_size=6))
        states = []
        hook = model.get_decoder().norm.register_forward_hook(
            lambda m, i, o: states.append(o.detach().reshape(-1, o.shape[-1])[-2:].clone()))
        engine.run([engine.encode(q) for q in first_turns(per_task=1)], max_new_tokens=24)
        hook.remove()
        X = torch.cat(states).float()  # [n, H]
        screen = engine.target.head.screen
        p = screen.int8.pass_
        if p is None:
            raise SystemExit("the int8 pass was not built (no AVX-512 VNNI here, or LOGITSPEC_INT8_SCREEN=off)")
        print(f"{len(X)} states")
        for n in (int(v) for v in args.rows.split(",")):
            x = X[:n].contiguous()
            scores, coef, floor = p(x)
            rows, toks = p.candidates(scores, coef, floor)
            print(f"{n:2d} rows: candidates a row {torch.bincount(rows, minlength=n).tolist()}")
            print(f"   pass {fastest_ms(lambda: p(x)):.2f} ms, search {fastest_ms(lambda: p.candidates(scores, coef, floor)):.2f}, "
                  f"rescoring {fastest_ms(lambda: head.best_candidate(screen.weight, x, rows, toks)):.2f}; "
                  f"whole int8 call {fastest_ms(lambda: screen._int8_greedy(x)):.2f} ms, "
                  f"other passes' call {fastest_ms(lambda: screen._screened(x, True)):.2f} "
                  f"(bfloat16 pass {fastest_ms(lambda: screen.passes['bf16'](x)):.2f}, "
                  f"fbgemm {fastest_ms(lambda: screen.passes['fbgemm'](x)):.2f})")


if __name__ == "__main__":
    main()

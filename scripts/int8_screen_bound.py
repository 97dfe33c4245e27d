"""How many tokens an int8 screen of the output layer would leave to rescore, on real final hidden states.

    .venv/bin/python scripts/int8_screen_bound.py [--model default] [--outliers 0,32] [--batch-sizes 6,24] [--time]

An exact screen computes approximate logits a_v, a provable bound e_v >= |a_v - exact_v| per token,
and rescores in float32 every token with a_v + e_v >= max_u (a_u - e_u). Weights: int8 per output row
(scale max|W_v| / 127). Three kinds:
- fbgemm as it is (``quantized::linear_dynamic`` with ``reduce_range``, the setting that keeps its
  int16 pair sums from saturating): it rounds the activations to 7 bits over the batch inside the
  call, so their error is known only as at most one step s an element:
  e_v = ||W~_v|| s sqrt(H) + ||dW_v|| ||x||; a_v is fbgemm's own output;
- int8 with known activations (a kernel that rounded them to 8 bits over the batch itself and
  reported the error): e_v = ||dW_v|| ||x~|| + ||W_v|| ||x~ - x||;
- weight-only int8 (float32 activations): e_v = ||dW_v|| ||x||.
The ``--outliers`` channels with the largest mean |x| are computed exactly in float32 and left out of
all three (Gemma 3's final states have channels of magnitude 45-130 against a median of 2.3). A float32
slack of 1e-4 ||W_v|| ||x|| is added. Prints the candidate counts per row, the bounds' violations
against the float32 logits (must be 0), and the gap between each state's two best logits.
``--time``: the output-layer pass alone, alternating, fastest of 20 calls: the screen's bfloat16
oneDNN pass, fbgemm's dynamic int8 (prepacked), and the engine's int8 pass (``logitspec.int8_screen``:
smoothed channels, 8-bit activations per row, ``vpdpbusd`` where the CPU has AVX-512 VNNI; it
computes its bound's floor too).
"""
import argparse
import time
import warnings

import torch

from logitspec import int8_screen
from logitspec.int8_screen import int8_rows, to_u8
from logitspec.bench.questions import first_turns
from logitspec.head import ROUNDING_SLACK
from logitspec.kernels import onednn
from logitspec.models import load_model


class FbgemmInt8:
    """fbgemm's dynamic int8 linear over :func:`int8_rows` of ``w`` [V, H] (prepacked), and the
    norms of its dequantized rows and of their error ([V] each)."""

    def __init__(self, w: torch.Tensor):
        _, scale = int8_rows(w)
        with warnings.catch_warnings():  # quantize_per_channel's deprecation notice
            warnings.simplefilter("ignore")
            wq = torch.quantize_per_channel(w, scale.double(), torch.zeros(len(w), dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(wq, None)
        deq = wq.dequantize()  # [V, H]
        self.wq_norm, self.dw_norm = deq.norm(dim=1), (deq - w).norm(dim=1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)  # reduce_range: 7-bit activations


def stats(counts: list[int]) -> str:
    c = torch.tensor(counts, dtype=torch.float)
    return f"median {c.median():.0f} p90 {torch.quantile(c, 0.9):.0f} max {c.max():.0f}"


def candidates(X: torch.Tensor, W: torch.Tensor, k: int, batch_sizes: list[int]):
    """Per batch size B: (B, per kind the candidate count of each row over ``X`` [n, H] in batches of
    B, the number of bound violations), with the ``k`` channels of largest mean |x| exact."""
    wn = W.norm(dim=1)  # [V]
    values, scale = int8_rows(W)
    Wq = values.float() * scale[:, None]  # [V, H] int8 values, dequantized
    dW = (Wq - W).norm(dim=1)  # [V]
    order = X.abs().mean(0).argsort(descending=True)
    O, R = order[:k], order[k:]
    WqR, WO = Wq[:, R].T.contiguous(), W[:, O].T.contiguous()  # [H-k, V], [k, V]
    fbgemm = FbgemmInt8(W[:, R].contiguous())
    for B in batch_sizes:
        counts, violations = {"fbgemm": [], "known": [], "weight-only": []}, 0
        for i in range(0, len(X) - B + 1, B):
            x = X[i:i + B]  # [B, H]
            xr, exact_part, exact = x[:, R].contiguous(), x[:, O] @ WO, x @ W.T  # [B, H-k], [B, V], [B, V]
            lo, hi = xr.min().double().clamp(max=0), xr.max().double().clamp(min=0)  # over the batch
            codes, step8, zero = to_u8(xr, lo, hi)
            xt = (codes - zero) * step8  # [B, H-k] uint8 values
            step7 = (hi - lo) / 127
            slack = 1e-4 * wn[None, :] * x.norm(dim=1)[:, None]  # [B, V]
            kinds = {
                "fbgemm": (fbgemm(xr) + exact_part, fbgemm.wq_norm[None, :] * step7 * xr.shape[1] ** 0.5
                           + fbgemm.dw_norm[None, :] * xr.norm(dim=1)[:, None] + slack),
                "known": (xt @ WqR + exact_part,
                          dW[None, :] * xt.norm(dim=1)[:, None] + wn[None, :] * (xt - xr).norm(dim=1)[:, None] + slack),
                "weight-only": (xr @ WqR + exact_part, dW[None, :] * xr.norm(dim=1)[:, None] + slack)}
            for name, (approx, bound) in kinds.items():  # [B, V] each
                violations += int(((approx - exact).abs() > bound).sum())
                floor = (approx - bound).amax(1, keepdim=True)  # [B, 1]
                counts[name] += ((approx + bound) >= floor).sum(1).tolist()
        yield B, counts, violations


def time_passes(W: torch.Tensor, batch_sizes: list[int], calls: int = 20) -> None:
    """ms per call of the screen's bfloat16 pass, fbgemm's dynamic int8 linear and the engine's int8 pass, alternating."""
    packed16 = onednn.pack(W.bfloat16())  # the screen's "bf16" pass (logitspec.head)
    passes = {"bf16": lambda x: onednn.linear(x.bfloat16(), packed16), "fbgemm int8": FbgemmInt8(W)}
    if int8_screen.available() and int8_screen.usable(W):
        vnni = "VNNI" if int8_screen.fast_here() else "plain loop"
        passes[f"int8 pass ({vnni})"] = int8_screen.Int8Pass(W, torch.randn(16, W.shape[1]) * 3, ROUNDING_SLACK)
    for B in batch_sizes:
        x = torch.randn(B, W.shape[1]) * 3
        best = {k: float("inf") for k in passes}
        for _ in range(3):
            for name, f in passes.items():
                f(x)
                for _ in range(calls):
                    t = time.perf_counter()
                    f(x)
                    best[name] = min(best[name], time.perf_counter() - t)
        print(f"{B:2d} rows: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--outliers", default="0,32", help="comma-separated counts of exact channels")
    ap.add_argument("--batch-sizes", default="6,24")
    ap.add_argument("--time", action="store_true", help="also time the bfloat16 pass against the int8 passes")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    sizes = [int(v) for v in args.batch_sizes.split(",")]
    with torch.inference_mode():
        W = model.get_output_embeddings().weight.float()  # [V, H]
        if args.time:
            time_passes(W, sizes)
        states = []
        for text in first_turns(None, 3, max_chars=1500)[:12]:  # Spec-Bench first turns, 300 tokens each at most
            ids = tok(text, return_tensors="pt").input_ids[:, :300]
            states.append(model.model(input_ids=ids).last_hidden_state[0])
        X = torch.cat(states)  # [n, H]
        top2 = (X @ W.T).topk(2, dim=1).values  # [n, 2]
        gap = top2[:, 0] - top2[:, 1]
        print(f"{len(X)} states; gap between the two best logits: p10 / p50 / p90 "
              f"{[round(v, 2) for v in torch.quantile(gap, torch.tensor([0.1, 0.5, 0.9])).tolist()]}")
        for k in (int(v) for v in args.outliers.split(",")):
            for B, counts, violations in candidates(X, W, k, sizes):
                print(f"exact channels {k:2d}, {B:2d} rows: candidates a row, "
                      + "; ".join(f"{name} {stats(c)}" for name, c in counts.items())
                      + f"; bound violations {violations}")


if __name__ == "__main__":
    main()

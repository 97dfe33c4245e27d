"""Decode attention: SDPA (grouped query heads stacked on their key head, as logitspec/attention.py
did) against the batch-invariant kernel (logitspec/kernels/decode_attention.py), cold caches.

    .venv/bin/python scripts/decode_attention_bench.py

Each case cycles over 18 layers' worth of keys and values (views of buffers with spare room, as
the engine's cache) so they come from memory as in a forward; ms per layer call, median of 6 rounds,
each method twice.
"""
import time

import torch
import torch.nn.functional as F

from logitspec.kernels import decode_attention

CASES = [  # B, H, KV, D, S, T
    (20, 4, 1, 256, 290, 1), (20, 4, 1, 256, 290, 4), (6, 4, 1, 256, 290, 1), (6, 4, 1, 256, 290, 8),
    (1, 4, 1, 256, 8192, 1), (1, 4, 1, 256, 8192, 10), (4, 14, 2, 64, 2000, 1), (1, 4, 1, 256, 600, 1),
    (24, 4, 1, 256, 180, 1), (24, 4, 1, 256, 180, 2), (24, 4, 1, 256, 440, 1), (4, 4, 1, 256, 4096, 2)]
# static batches of unequal rows, 32 tokens decoded: each row sees its committed columns and the
# step's node at the end (the others are the holes between its end and the widest row's). The
# throughput harness's 6 prompts four times, and four long documents as in a LongBench sweep.
RAGGED = ([10, 23, 28, 55, 264, 322] * 4, [2000, 4000, 8000, 16000])


def sdpa(q, k, v, mask, scale, G):
    B, KV, S, D = k.shape
    T = q.shape[2]
    return F.scaled_dot_product_attention(q.reshape(B, KV, G * T, D), k, v, scale=scale,
                                          attn_mask=mask.expand(B, G, T, S).reshape(B, 1, G * T, S))


def kernel(q, k, v, mask, scale, G):
    return decode_attention.attention(q, k, v, mask, scale)


def main() -> None:
    torch.set_num_threads(2)
    print("| B, H, KV, D, S, T | SDPA ms | kernel ms | KV MB seen a layer | kernel GB/s |\n|---|---|---|---|---|")
    cases = [(*c, None) for c in CASES] + [(len(r), 4, 1, 256, max(r) + 33, 1, r) for r in RAGGED]
    for B, H, KV, D, S, T, rows in cases:
        G = H // KV
        layers = [(torch.randn(B, KV, S + 100, D), torch.randn(B, KV, S + 100, D)) for _ in range(18)]
        q = torch.randn(B, H, T, D)
        mask = torch.zeros(B, 1, T, S)
        if rows is None:
            mask[..., -3:] = torch.finfo(torch.float32).min
        for b, n in enumerate(rows or []):
            mask[b, :, :, n + 32:S - 1] = torch.finfo(torch.float32).min
        res = {}
        with torch.inference_mode():
            for name, f in (("sdpa", sdpa), ("kernel", kernel), ("sdpa2", sdpa), ("kernel2", kernel)):
                ts = []
                for _ in range(6):
                    t0 = time.perf_counter()
                    for kb, vb in layers:
                        f(q, kb[:, :, :S], vb[:, :, :S], mask, D ** -0.5, G)
                    ts.append(time.perf_counter() - t0)
                res[name] = sorted(ts)[2] * 1e3 / 18
        mb = int((mask == 0).any(dim=2).sum()) * KV * D * 8 / 1e6  # the keys and values some node sees
        print(f"| {B}, {H}, {KV}, {D}, {S}, {T} | {res['sdpa']:.2f} / {res['sdpa2']:.2f} | "
              f"{res['kernel']:.2f} / {res['kernel2']:.2f} | {mb:.1f} | {mb / min(res['kernel'], res['kernel2']):.1f} |")


if __name__ == "__main__":
    main()

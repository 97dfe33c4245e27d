"""The target forward of one step: the decoder over all packed nodes, then the output layer only
where needed.

On CPU the output projection (262k x 640 for Gemma 3: 671 MB of float32) costs as much as the
whole decoder at one token and grows with every verified node. Two things make it cheap:

* logits only for real tree nodes (padding skipped; prefill: last position only);
* for greedy decoding, an exact argmax screened at half precision (:class:`ScreenedArgmax`): one
  pass over a float16 copy of the weight (fbgemm's fp16 GEMM for up to 4 nodes, our F16C skinny
  kernel for more; float32 products and sums) gives
  approximate logits with a proven error bound; only the tokens that can still be the float32
  argmax (almost always one) are rescored in float32. The argmax is the float32 one; the
  approximate logits serve ranking only (LogitSpec's next-next guesses).

Sampling on the host draws from the screen too (:mod:`logitspec.sampling`: float32 logits only
where the bound cannot decide, only at the nodes a tree walk visits); with ``exact`` it gets the
full float32 rows (the device path, ``Engine(screened_sampling=False)``). The screen is for float32
weights on CPU only; elsewhere (a GPU, or half precision) the output layer is one plain GEMM in the
model's dtype over the selected nodes. ``fast=False`` uses the model's own forward (needed when the
output layer is sharded, e.g. DeepSpeed AutoTP).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .kernels import skinny

log = logging.getLogger("logitspec.head")

# |fp32 dot - exact dot| <= gamma_n * |w| |x| with gamma_n ~ n * 2^-24 (worst case over summation
# orders; 3.8e-5 for n = 640). Both the screen and the reference round, hence twice, with headroom.
ROUNDING_SLACK = 1e-4


@dataclass
class NodeLogits:
    """Output-layer results for the N selected nodes of one forward. Screened results (``exact``
    False) carry the nodes' hidden states and the screen, so that exact float32 values can be
    computed later for the nodes that need them (the argmax, or a sampled draw:
    :func:`~logitspec.sampling.draw`)."""

    scores: torch.Tensor  # [N, V]: float32 logits if ``exact``, else approximations for ranking only
    exact: bool
    screened_argmax: torch.Tensor | None = None  # [N] int64: the exact argmax of screened scores, once known
    hidden: torch.Tensor | None = None  # [N, H] float32: the nodes' hidden states, with screened scores
    screen: "ScreenedArgmax | None" = None  # the screen that produced ``scores``, when not exact

    @property
    def argmax(self) -> torch.Tensor:
        """[N] int64: the float32 argmax token of each node (the greedy choice); computed when first
        asked (sampling never asks)."""
        if self.screened_argmax is None and self.screen is not None:
            self.screened_argmax = self.screen.exact_argmax(self.scores, self.hidden)
        return self.screened_argmax if self.screened_argmax is not None else self.scores.argmax(dim=-1)

    def __getitem__(self, rows: slice) -> "NodeLogits":
        arg = self.screened_argmax[rows] if self.screened_argmax is not None else None
        hidden = self.hidden[rows] if self.hidden is not None else None
        return NodeLogits(self.scores[rows], self.exact, arg, hidden, self.screen)


class ScreenedArgmax:
    """Exact float32 argmax of ``W @ x`` from one float16 pass plus a few float32 dot products.

    With ``W16`` the float16 copy, ``|W16_v . x - W_v . x| <= ||W16_v - W_v|| ||x||``; add float32
    rounding of both computations (``ROUNDING_SLACK * ||W_v|| ||x||``) and call the largest such
    bound over the vocabulary ``B(x)``. Every token whose approximate logit is within ``2 B(x)`` of
    the best approximate logit is a candidate; the float32 argmax is always among them.
    """

    KINDS = ("both", "f16c", "fbgemm")
    FBGEMM_MAX_ROWS = 4  # "both": fbgemm up to this many rows, the F16C kernel above

    def __init__(self, weight: torch.Tensor, kind: str | None = None):
        """``kind``: the float16 pass. "f16c": the skinny kernel (reads the float16 weight once for up
        to 64 rows); "fbgemm": fbgemm's fp16 GEMM; "both" (the default where both exist): fbgemm for
        up to ``FBGEMM_MAX_ROWS`` rows, where it streams faster, the F16C kernel above (timings in
        docs/performance.md, ``scripts/head_bench.py``), at the price of a second float16 copy of the
        weight. ValueError for a pass this machine lacks."""
        w = weight.detach()  # [V, H] float32
        self.weight = w
        w16 = w.half()  # [V, H]
        fbgemm = has_fbgemm()
        self.kind = kind or ("both" if skinny.available() and fbgemm else "f16c" if skinny.available() else "fbgemm")
        if self.kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        if (self.kind != "fbgemm" and not skinny.available()) or (self.kind != "f16c" and not fbgemm):
            raise ValueError(f"screen {self.kind!r} is not available here (skinny kernel: {skinny.available()}, "
                             f"fbgemm: {fbgemm})")
        self.w16 = w16.contiguous() if self.kind in ("both", "f16c") else None
        self.packed = torch.ops.quantized.linear_prepack_fp16(w, None) if self.kind in ("both", "fbgemm") else None
        err = (w - w16.float()).norm(dim=1).max().item()
        self.bound_per_norm = err + ROUNDING_SLACK * w.norm(dim=1).max().item()  # B(x) / ||x||

    def approx_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[N, V] float32 logits of ``x`` [N, H] against the float16 weight (error <= the bound)."""
        if self.packed is not None and (self.w16 is None or len(x) <= self.FBGEMM_MAX_ROWS):
            return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        if len(x) <= skinny.MAX_ROWS:  # the usual step: no [N, V] copy through torch.cat
            return skinny.skinny_linear_f16(x, self.w16)
        chunks = range(0, len(x), skinny.MAX_ROWS)
        return torch.cat([skinny.skinny_linear_f16(x[i:i + skinny.MAX_ROWS], self.w16) for i in chunks])

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and (skinny.available() or has_fbgemm())

    def __call__(self, x: torch.Tensor, argmax: bool = True) -> NodeLogits:
        """``x`` [N, H] float32 hidden states -> approximate logits [N, V] and the exact argmax [N]
        (``argmax=False``: computed only if asked; sampling draws from the screen instead)."""
        approx = self.approx_logits(x)  # [N, V]
        out = NodeLogits(approx, exact=False, hidden=x, screen=self)
        if argmax:
            out.screened_argmax = self.exact_argmax(approx, x)
        return out

    def exact_argmax(self, approx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[N] int64: the float32 argmax of ``W @ x`` per row of ``x`` [N, H], from its screened
        logits ``approx`` [N, V]: only tokens within twice the bound of the best are rescored."""
        best = approx.max(dim=1).values  # [N]
        margin = 2 * self.bound_per_norm * x.norm(dim=1)  # [N]
        rows, toks = torch.nonzero(approx >= (best - margin)[:, None], as_tuple=True)  # [K] each
        exact = (self.weight[toks] * x[rows]).sum(dim=1)  # [K] float32 logits of the candidates
        # per row: the largest exact logit, ties to the lowest token id (torch.argmax's rule)
        n, vocab = x.shape[0], self.weight.shape[0]
        top = torch.full((n,), float("-inf")).scatter_reduce(0, rows, exact, "amax")  # [N]
        lowest = torch.where(exact == top[rows], toks, vocab)  # [K]
        arg = torch.full((n,), vocab).scatter_reduce(0, rows, lowest, "amin")  # [N]
        lost = torch.nonzero(arg == vocab).squeeze(1)  # rows without a candidate (non-finite input)
        if len(lost):
            arg[lost] = torch.mm(self.weight, x[lost].T).argmax(dim=0)
        return arg


def has_fbgemm() -> bool:
    try:
        return "fbgemm" in torch.backends.quantized.supported_engines and \
            hasattr(torch.ops.quantized, "linear_dynamic_fp16")
    except RuntimeError:
        return False


class Head:
    def __init__(self, model, fast: bool = True):
        """Greedy steps use :class:`ScreenedArgmax` where the output weights allow it."""
        self.model = model
        emb = model.get_output_embeddings()
        cfg = model.config.get_text_config(decoder=True)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        usable = (emb is not None and getattr(emb, "bias", None) is None
                  and tuple(emb.weight.shape) == (cfg.vocab_size, cfg.hidden_size) and hasattr(model, "get_decoder"))
        self.fast = fast and usable
        self.screen = None
        if self.fast:
            self.decoder = model.get_decoder()
            self.weight = emb.weight  # [V, H]
            # soft-capped logits can tie after tanh where the raw ones do not: screen raw logits only
            if not self.softcap and ScreenedArgmax.supported(self.weight):
                self.screen = ScreenedArgmax(self.weight)

    def __call__(self, ids, pos, mask, cache, select: torch.Tensor, exact: bool = True,
                 argmax: bool = True) -> NodeLogits:
        """Output-layer results of the flat node indices ``select`` [N] into the [B, T] batch; the
        cache gains all B x T new columns. ``exact=False`` allows screened (approximate) scores, with
        the exact argmax unless ``argmax=False`` (sampling: draws from the screen, see
        :mod:`logitspec.sampling`)."""
        if self.fast:
            out = self.decoder(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True)
            return self.output(out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])[select], exact,
                               argmax)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True)
        return NodeLogits(out.logits.reshape(-1, out.logits.shape[-1])[select], exact=True)

    def output(self, h: torch.Tensor, exact: bool = True, argmax: bool = True) -> NodeLogits:
        """The output layer over final hidden states ``h`` [N, H] (needs ``fast``); ``exact``,
        ``argmax`` as for :meth:`__call__`."""
        if self.screen is not None and not exact:
            return self.screen(h, argmax=argmax)
        # on CPU W @ h.T ran 3-4x faster than h @ W.T at 2-8 rows (shared/FINDINGS.md); elsewhere
        # one GEMM in the model's dtype, [N, V] contiguous for the argmax and top-k that follow
        logits = torch.mm(self.weight, h.T).T if h.device.type == "cpu" else h @ self.weight.T  # [N, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return NodeLogits(logits, exact=True)

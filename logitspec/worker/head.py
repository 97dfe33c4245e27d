"""The target forward of one step: the decoder over all packed nodes, then the output layer only
where needed.

On CPU the output projection (262k x 640 for Gemma 3: 671 MB of float32) costs as much as the
whole decoder at one token and grows with every verified node. Two things make it cheap:

* logits only for real tree nodes (padding skipped; prefill: last position only);
* for greedy decoding, an exact argmax screened by one fast pass (:class:`ScreenedArgmax`): over a
  float16 copy of the weight (fbgemm's fp16 GEMM, or our F16C skinny kernel; float32 products and
  sums) or a packed float32 copy (oneDNN, the fastest from about 24 nodes), whichever was timed the
  fastest for the step's node count; it gives approximate logits with a proven error bound, and
  only the tokens that can still be the float32 argmax (almost always one) are rescored in
  float32. The argmax is the float32 one; the approximate logits serve ranking only (LogitSpec's
  next-next guesses). One screen per output weight, shared by every engine on the model;
* for greedy calls of up to 16 nodes, an int8 pass (:mod:`logitspec.sample.int8_screen`: half the bytes of
  bfloat16, a bound per token), where AVX-512 VNNI runs it and it is timed the faster per row count.

Sampling on the host draws from the screen too (:mod:`logitspec.sample.screened`: float32 logits only
where the bound cannot decide, only at the nodes a tree walk visits); with ``exact`` it gets the
full float32 rows (the device path, ``Engine(screened_sampling=False)``). The screen is for float32
and bfloat16 weights on CPU; a bfloat16 model's logits are then the float32 products of its weights
widened exactly (one float32 copy), the same bits in any batch, where bfloat16 GEMMs are not.
Elsewhere (a GPU, float16) the output layer is one plain GEMM in the model's dtype over the
selected nodes. A tensor-parallel rank's output layer (``sharded=True``: split by vocabulary,
:mod:`logitspec.worker.vocab_parallel`, or AutoTP's, split along the hidden size) runs as its own
collective module over the selected nodes; greedy choices from a vocabulary-parallel one gather only
each rank's best tokens (:meth:`Head.top`). ``fast=False`` uses the model's own forward (logits at
every position).
"""
from __future__ import annotations

import logging
import os
import time
import weakref

import torch

from logitspec.kernels import onednn, skinny
from logitspec.sample import screened
from logitspec.sample.int8_screen import MAX_CANDIDATES_PER_ROW, Int8Race
from logitspec.sample.node_logits import NodeLogits, OutputMode
from logitspec.sample.params import SamplingParams
from logitspec.sample.sampler import scores_extension
from logitspec.worker.vocab_parallel import VocabParallelHead

log = logging.getLogger("logitspec.worker.head")

# the int8 pass of greedy calls (:mod:`logitspec.sample.int8_screen`): "auto" (where AVX-512 VNNI runs it:
# timed
# against the other passes per row count, kept where faster), "on" (always, e.g. tests), "off";
# read when a screen is made (environment variable LOGITSPEC_INT8_SCREEN)
INT8 = os.environ.get("LOGITSPEC_INT8_SCREEN", "auto")
# |fp32 dot - exact dot| <= gamma_n * |w| |x| with gamma_n ~ n * 2^-24 (worst case over summation
# orders; 3.8e-5 for n = 640). Both the screen and the reference round, hence twice, with headroom.
ROUNDING_SLACK = 1e-4


class ScreenedArgmax:
    """Exact float32 argmax of ``W @ x`` from one fast approximate pass plus a few float32 dot products.

    A pass gives approximate logits with a proven bound. For the float16 passes, with ``W16`` the
    float16 copy, ``|W16_v . x - W_v . x| <= ||W16_v - W_v|| ||x||``; add float32 rounding of both
    computations (``ROUNDING_SLACK * ||W_v|| ||x||``; the oneDNN float32 pass errs by that alone)
    and call the largest such bound over the vocabulary ``B(x)``. Every token whose approximate
    logit is within ``2 B(x)`` of the best approximate logit is a candidate; the float32 argmax is
    always among them.
    """

    KINDS = ("auto", "f16c", "fbgemm", "onednn", "bf16")
    TRIALS = 2  # "auto": timed calls of each pass per row-count bucket before it settles on one
    # ... unless, after one call each, a pass is this many times slower than the fastest: then the
    # bucket settles at once, and larger buckets take its choice untimed (a pass that loses by 2x at
    # N rows loses by more at 2N: fbgemm at 24 rows cost 55 ms against bfloat16's 18, at 144 rows
    # 343 against 83, and each trial of the loser at 100+ rows cost a third of a second)
    DECISIVE = 2.0

    def __init__(self, weight: torch.Tensor, kind: str | None = None, clock=time.perf_counter):
        """``kind``: the approximate pass. "f16c": the skinny kernel over a float16 copy (reads it
        once for up to 64 rows); "fbgemm": fbgemm's fp16 GEMM; "onednn": oneDNN's float32 GEMM over
        a packed copy; "bf16": oneDNN's bfloat16 GEMM (inputs and weights rounded to bfloat16,
        float32 sums; the fastest past a few rows where the CPU has bfloat16 dot products);
        "auto" (the default): fbgemm and the bfloat16 pass (oneDNN float32 where bfloat16 is not
        supported; the F16C kernel where one of them is missing), the faster per row count as
        timed on the first calls of each size (:meth:`approx_logits`) by ``clock`` (seconds).
        ValueError for a pass this machine lacks."""
        w = weight.detach().float()  # [V, H] float32 (a bfloat16 weight widened exactly: a copy)
        self.weight = w
        bf16 = onednn.available() and onednn.bf16_supported()
        have = [k for k, ok in (("fbgemm", has_fbgemm()), ("bf16", bf16),
                                ("onednn", onednn.available()), ("f16c", skinny.available())) if ok]
        self.kind = kind or "auto"
        if self.kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        if self.kind != "auto" and self.kind not in have:
            raise ValueError(f"screen {self.kind!r} is not available here (available: {have})")
        use = [self.kind] if self.kind != "auto" else self._auto_set(have)
        if not use:
            raise ValueError("no screen pass is available here (no fbgemm, oneDNN or skinny kernel)")
        self.passes = {k: self._pass(k, w) for k in use}
        self.bound_per_norm = max(self._bound_per_norm(k, w) for k in use)  # B(x) / ||x|| for any pass used
        self.clock = clock
        self._chosen: dict[int, str] = {}  # row-count bucket -> pass
        self._times: dict[int, dict[str, list[float]]] = {}  # "auto" trials: bucket -> pass -> seconds
        self._decisive: set[int] = set()  # buckets whose trials found a pass DECISIVE times slower
        self.int8 = Int8Race(w, INT8, ROUNDING_SLACK)

    @staticmethod
    def _auto_set(have: list[str]) -> list[str]:
        """Two passes to time against each other: fbgemm and the fastest oneDNN one there is."""
        dnnl = next((k for k in ("bf16", "onednn") if k in have), None)
        pair = [k for k in ("fbgemm", dnnl) if k in have]
        return pair if len(pair) == 2 else pair + [k for k in ("f16c",) if k in have and k not in pair]

    @staticmethod
    def _bound_per_norm(kind: str, w: torch.Tensor) -> float:
        """The largest ``|approx - exact| / ||x||`` over the vocabulary for pass ``kind``: float32
        rounding of both sums (``ROUNDING_SLACK``) plus, for the float16 passes, the weight's
        rounding ``||W16_v - W_v||``; for bfloat16 also the input's and the output's (oneDNN returns
        bfloat16): with ``u = 2^-8`` (bfloat16's unit roundoff: ``|x~_i - x_i| <= u |x_i|``),
        ``||W~_v - W_v|| ||x~|| + ||W_v|| ||x~ - x|| + u ||W~_v|| ||x~||``, ``||x~|| <= (1 + u) ||x||``."""
        norms = w.norm(dim=1)  # [V]
        slack = ROUNDING_SLACK * norms.max().item()
        if kind == "onednn":
            return slack
        if kind == "bf16":
            u = 2.0 ** -8
            dw = (w - w.bfloat16().float()).norm(dim=1)  # [V]
            return (dw * (1 + u) + norms * u + u * (1 + u) * (norms + dw)).max().item() + slack
        return (w - w.half().float()).norm(dim=1).max().item() + slack

    @staticmethod
    def _pass(kind: str, w: torch.Tensor):
        """The approximate pass ``x`` [N, H] -> [N, V] float32 of ``kind``, holding its own copy of ``w``."""
        if kind == "fbgemm":
            packed16 = torch.ops.quantized.linear_prepack_fp16(w, None)
            return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed16)
        if kind == "onednn":
            packed = onednn.pack(w)
            return lambda x: onednn.linear(x, packed)
        if kind == "bf16":  # its bfloat16 logits as they come: widened only where read in float32
            packed = onednn.pack(w.bfloat16())
            return lambda x: onednn.linear(x.bfloat16(), packed)
        w16 = w.half().contiguous()  # [V, H]

        def f16c(x):
            if len(x) <= skinny.MAX_ROWS:  # the usual step: no [N, V] copy through torch.cat
                return skinny.skinny_linear_f16(x, w16)
            chunks = range(0, len(x), skinny.MAX_ROWS)
            return torch.cat([skinny.skinny_linear_f16(x[i:i + skinny.MAX_ROWS], w16) for i in chunks])
        return f16c

    @staticmethod
    def _bucket(rows: int) -> int:
        return rows if rows <= 8 else min(1 << (rows - 1).bit_length(), 256)

    def approx_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[N, V] logits of ``x`` [N, H] from the pass chosen for N rows (error <= the bound): float32,
        or bfloat16 from the bfloat16 pass (a [24, 262k] float32 copy cost 3 ms a step).
        With several passes, the first ``TRIALS`` calls of each per bucket of row counts time them in
        turn; the fastest is used from then on (see ``DECISIVE`` for when fewer trials decide)."""
        if len(self.passes) == 1:
            return next(iter(self.passes.values()))(x)
        b = self._bucket(len(x))
        name = self._chosen.get(b) or self._inherited(b)
        if name is not None:
            return self.passes[name](x)
        times = self._times.setdefault(b, {k: [] for k in self.passes})
        name = min(times, key=lambda k: len(times[k]))
        t0 = self.clock()
        out = self.passes[name](x)
        times[name].append(self.clock() - t0)
        if all(times.values()):
            best = {k: min(t) for k, t in times.items()}
            decisive = max(best.values()) >= self.DECISIVE * min(best.values())
            if decisive or all(len(t) >= self.TRIALS for t in times.values()):
                self._chosen[b] = min(best, key=best.get)
                if decisive:
                    self._decisive.add(b)
                log.debug("screen pass for %d rows: %s (%s)", b, self._chosen[b],
                          {k: round(v * 1e3, 1) for k, v in best.items()})
        return out

    def _inherited(self, bucket: int) -> str | None:
        """The pass of the largest smaller bucket, if its trials were decisive (and then settled for
        ``bucket`` too, untimed); else None."""
        below = [b for b in self._chosen if b < bucket]
        if not below or max(below) not in self._decisive:
            return None
        b = max(below)
        self._chosen[bucket] = self._chosen[b]
        self._decisive.add(bucket)
        log.debug("screen pass for %d rows: %s (as for %d rows, decisively)", bucket, self._chosen[b], b)
        return self._chosen[bucket]

    def settle(self, rows: int, device="cpu") -> None:
        """Run the timing trials of ``rows`` rows' bucket now (random hidden states), so that later
        calls of that size, e.g. a cost measurement's, all use the pass kept."""
        if len(self.passes) == 1:
            return
        x = torch.randn(rows, self.weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(device)
        while self._chosen.get(self._bucket(rows)) is None:
            self.approx_logits(x)

    def choices(self) -> dict[int, str]:
        """The pass settled on per row-count bucket so far (one pass: it, under bucket 0)."""
        return dict(self._chosen) if len(self.passes) > 1 else {0: next(iter(self.passes))}

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and (
            skinny.available() or has_fbgemm() or onednn.available())

    def __call__(self, x: torch.Tensor, argmax: bool = True) -> NodeLogits:
        """``x`` [N, H] float32 hidden states -> approximate logits [N, V] and the exact argmax [N]
        (``argmax=False``: computed only if asked; sampling draws from the screen instead, in float32).
        A greedy call of few rows may take the int8 pass instead (:class:`Int8Race`)."""
        if not (argmax and self.int8.offered(x)):
            return self._screened(x, argmax)
        use = self.int8.choose(x)
        t0 = time.perf_counter()
        out = self._int8_greedy(x) if use else self._screened(x, True)
        self.int8.record(len(x), use, time.perf_counter() - t0)
        return out

    def _int8_greedy(self, x: torch.Tensor) -> NodeLogits:
        """The int8 pass's scores (ranking only) and the exact argmax among its candidates; no
        ``screen`` on the result: its bound is per token, not the screen's (sampling never comes here).
        Where its wider bound leaves too many candidates (a flat distribution: tens of thousands a
        row, each a weight row to read), the other passes serve the call after all."""
        scores, coef, floor = self.int8.pass_(x)  # [N, V], [N, 3], [N]
        rows, toks = self.int8.pass_.candidates(scores, coef, floor)
        if len(toks) > MAX_CANDIDATES_PER_ROW * len(x):
            return self._screened(x, True)
        best = best_candidate(self.weight, x, rows, toks)
        return NodeLogits(scores, exact=False, screened_argmax=best, hidden=x)

    def _screened(self, x: torch.Tensor, argmax: bool) -> NodeLogits:
        approx = self.approx_logits(x)  # [N, V]: float32 or bfloat16
        if not argmax:
            approx = approx.float()  # sampling's softmax and sums run in float32
        out = NodeLogits(approx, exact=False, hidden=x, screen=self)
        if argmax:
            out.screened_argmax = self.exact_argmax(approx, x)
        return out

    def sample(self, approx: torch.Tensor, x: torch.Tensor, params: SamplingParams, u: float) -> int:
        """The exact draw with uniform ``u`` (:func:`~logitspec.sample.screened.screened_sample`) at one
        node with hidden state ``x`` [H] and screened logits ``approx`` [V]."""
        bound = self.bound_per_norm * float(x.norm())
        return screened.screened_sample(approx, x, self.weight, bound, params, u)

    def exact_argmax(self, approx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[N] int64: the float32 argmax of ``W @ x`` per row of ``x`` [N, H], from its screened
        logits ``approx`` [N, V]: only tokens within twice the bound of the best are rescored."""
        margin = 2 * self.bound_per_norm * x.norm(dim=1)  # [N]
        rows, toks = _candidates(approx, margin)  # [K] each
        return best_candidate(self.weight, x, rows, toks)


def best_candidate(weight: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
                   toks: torch.Tensor) -> torch.Tensor:
    """[N] int64: per row of ``x`` [N, H], the float32 argmax of ``weight @ x`` among its candidate
    tokens (``rows``, ``toks`` [K]; a row without any, e.g. a non-finite input: over all tokens)."""
    exact = _rescore(weight, x, rows, toks)  # [K] float32 logits of the candidates
    # per row: the largest exact logit, ties to the lowest token id (torch.argmax's rule)
    n, vocab = x.shape[0], weight.shape[0]
    top = torch.full((n,), float("-inf")).scatter_reduce(0, rows, exact, "amax")  # [N]
    lowest = torch.where(exact == top[rows], toks, vocab)  # [K]
    arg = torch.full((n,), vocab).scatter_reduce(0, rows, lowest, "amin")  # [N]
    lost = torch.nonzero(arg == vocab).squeeze(1)  # rows without a candidate (non-finite input)
    if len(lost):
        arg[lost] = torch.mm(weight, x[lost].T).argmax(dim=0)
    return arg


def _cpu_extension(t: torch.Tensor):
    """The compiled CPU kernels for a float32 CPU tensor ``t``, or None (then torch does the work)."""
    return skinny.extension() if t.device.type == "cpu" and t.dtype == torch.float32 else None


def torch_candidates(approx: torch.Tensor, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_candidates` in torch operations (the kernel's reference; any device)."""
    best = approx.amax(dim=1)  # [N] (values only: far faster than max with indices)
    return torch.nonzero(approx >= (best - margin)[:, None], as_tuple=True)


def _candidates(approx: torch.Tensor, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, tokens) [K] each: per row of ``approx`` [N, V] (float32 or bfloat16) the tokens within
    ``margin`` [N] of its
    best, rows in order, tokens ascending; one pass over each row by the compiled kernel where it is
    built (24 rows of 262k: 1.2 ms against 7.8 for amax, the comparison and ``nonzero``)."""
    ext = scores_extension(approx)
    if ext is None:
        return torch_candidates(approx, margin)
    return tuple(ext.screen_candidates(approx.contiguous(), margin.float().contiguous()))


def _rescore(weight: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
    """[K] float32: ``weight[toks[k]] . x[rows[k]]``, by the compiled kernel where it is built (no
    [K, H] gather: a flat distribution leaves tens of thousands of candidates)."""
    ext = _cpu_extension(x)
    if ext is None or not weight.is_contiguous():
        return (weight[toks] * x[rows]).sum(dim=1)
    return ext.rescore(weight, x.contiguous(), rows.contiguous(), toks.contiguous())


_SCREENS: dict[int, tuple[weakref.ref, "ScreenedArgmax"]] = {}  # id(weight) -> (weight, its screen)


def shared_screen(weight: torch.Tensor) -> "ScreenedArgmax":
    """The :class:`ScreenedArgmax` of ``weight`` (an output-layer parameter), made once per weight:
    engines over one model share its copies of the weight and its timing of the passes (dropped
    with the weight)."""
    held = _SCREENS.get(id(weight))
    if held is not None and held[0]() is weight:
        return held[1]
    for key in [k for k, (ref, _) in _SCREENS.items() if ref() is None]:
        del _SCREENS[key]
    screen = ScreenedArgmax(weight)
    _SCREENS[id(weight)] = (weakref.ref(weight), screen)
    return screen


def has_fbgemm() -> bool:
    try:
        return "fbgemm" in torch.backends.quantized.supported_engines and \
            hasattr(torch.ops.quantized, "linear_dynamic_fp16")
    except RuntimeError:
        return False


class Head:
    def __init__(self, model, fast: bool = True, sharded: bool = False):
        """Greedy steps use :class:`ScreenedArgmax` where the output weights allow it. ``sharded``: the
        output layer is a module that computes the full logits of its input collectively (a
        tensor-parallel rank's), called on the selected nodes' hidden states ``[1, N, H]``."""
        self.model = model
        emb = model.get_output_embeddings()
        cfg = model.config.get_text_config(decoder=True)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.hidden_size = int(cfg.hidden_size)
        whole = emb is not None and tuple(emb.weight.shape) == (cfg.vocab_size, cfg.hidden_size)
        usable = (emb is not None and getattr(emb, "bias", None) is None and (whole or sharded)
                  and hasattr(model, "get_decoder"))
        self.fast = fast and usable
        self.module = emb if self.fast and sharded else None
        self.screen = None
        # f(ids, pos, hidden) after every decoder forward, outside any captured step (a tensor-parallel
        # group's LogitsConsensus.observe): a forward hook would run once, in a capture, never in replays
        self.checks: list = []
        if self.fast:
            self.decoder = model.get_decoder()
        if self.fast and self.module is None:
            self.weight = emb.weight  # [V, H]
            # soft-capped logits can tie after tanh where the raw ones do not: screen raw logits only
            if not self.softcap and ScreenedArgmax.supported(self.weight):
                self.screen = shared_screen(self.weight)

    def __call__(self, ids, pos, mask, cache, select: torch.Tensor, mode: OutputMode = OutputMode.EXACT,
                 attn: dict | None = None) -> NodeLogits:
        """Output-layer results (``mode``) of the flat node indices ``select`` [N] into the [B, T]
        batch; the cache gains all B x T new columns. ``attn``: keywords for
        :mod:`logitspec.worker.attention` (other attention functions ignore them; the mask alone is exact)."""
        extra = attn or {}
        if self.fast:
            out = self.decoder(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache,
                               use_cache=True, **extra)
            h = out.last_hidden_state  # [B, T, H]
            self.after_forward(ids, pos, h)
            return self.output(h.reshape(-1, h.shape[-1])[select], mode)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True,
                         **extra)
        return NodeLogits(out.logits.reshape(-1, out.logits.shape[-1])[select], exact=True)

    def after_forward(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor) -> None:
        """Run :attr:`checks` on a decoder forward's inputs and final hidden states."""
        for check in self.checks:
            check(ids, pos, hidden)

    def top(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """``[N, k]`` int64: the ``k`` best tokens of final hidden states ``h`` [N, H], best first (``k =
        1``: the argmax, ties to the lowest id). A vocabulary-parallel output layer
        (:class:`~logitspec.worker.vocab_parallel.VocabParallelHead`) gathers only each rank's best,
        never the logits; otherwise from :meth:`output`'s logits. Fixed shapes, no host read."""
        if isinstance(self.module, VocabParallelHead):
            return self.module.top(h, k, self.softcap)
        scores = self.output(h, OutputMode.EXACT).scores  # [N, V]
        return scores.argmax(-1, keepdim=True) if k == 1 else torch.topk(scores, k, dim=-1).indices

    def output(self, h: torch.Tensor, mode: OutputMode = OutputMode.EXACT) -> NodeLogits:
        """The output layer (``mode``) over final hidden states ``h`` [N, H] (needs ``fast``)."""
        if self.module is not None:  # every rank calls it alike: its collective needs them all
            logits = self.module(h[None])[0]  # [N, V]
        else:
            if self.screen is not None:  # a bfloat16 model's logits: float32 products of its widened weights
                h = h.float()
                if mode is not OutputMode.EXACT:
                    return self.screen(h, argmax=mode is OutputMode.GREEDY)
            w = self.screen.weight if self.screen is not None else self.weight  # [V, H]
            # on CPU W @ h.T ran 3-4x faster than h @ W.T at 2-8 rows (docs/performance.md); elsewhere
            # one GEMM in the model's dtype, [N, V] contiguous for the argmax and top-k that follow
            logits = torch.mm(w, h.T).T if h.device.type == "cpu" else h @ w.T  # [N, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.screen is not None:  # greedy rows of a batch that needs these rows: the screen's argmax
            return NodeLogits(logits, exact=True, hidden=h, screen=self.screen)
        return NodeLogits(logits, exact=True)

"""An int8 pass for the greedy output-layer screen: approximate logits from u8 activations and s8
weights (exact integer sums: AVX-512 VNNI's ``vpdpbusd`` where the CPU has it), with a proven bound
per token, so the float32 argmax is found among the few tokens the bound cannot rule out.

At a few rows the pass reads the output weight as int8 (168 MB for Gemma 3's 262k x 640, against 335 MB
for the bfloat16 pass), which is what a few-row pass costs on a CPU at its memory rate.

**Smoothing.** Final hidden states have a few channels far larger than the rest (Gemma 3: 45-130
against a median of 2.3); rounding a row to 8 bits over its whole range would lose the small ones.
Each channel c is divided by a scale ``s_c`` and the weight's column multiplied by it
(``x' = x / s``, ``W' = W * s``: the same products), with ``s_c = sqrt(max |x_c|)`` over the first
rows the screen sees. Any ``s`` keeps the bound true; a good one keeps it narrow.

**The bound.** Per row, ``x'`` is rounded to 8 bits over its range (``x~``, with step and zero
point); each weight row ``W'_v`` is rounded to int8 with its own scale (``W~_v``). The pass computes
``a_v = x~ . W~_v`` exactly (integers, then one float scale), and

    |a_v - x . W_v| <= ||x~|| ||W~_v - W'_v|| + ||x~ - x'|| ||W'_v|| + slack ||W_v|| ||x||

(Cauchy-Schwarz on each rounding; ``slack`` = ``head.ROUNDING_SLACK`` covers float32 rounding of the
float32 reference, of the scaling and of the pass's final multiply). Every token whose ``a_v + e_v``
reaches the row's largest ``a_u - e_u`` is rescored in float32: the float32 argmax is among them.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from logitspec.kernels import skinny

log = logging.getLogger("logitspec.sample.int8_screen")
# more candidates a row than this on average, and a call takes the other passes after all: rescoring
# reads a weight row a candidate (2,048 rows of 640: 5 MB), the bfloat16 pass's tight bound few
MAX_CANDIDATES_PER_ROW = 2048
MAX_ROWS = 16  # rows per call the pass is offered for (the race keeps it only where it is faster)


def available() -> bool:
    """Whether the compiled kernels are built (the pass itself runs on any CPU they build on)."""
    return skinny.available()


def fast_here() -> bool:
    """Whether the pass runs AVX-512 VNNI here (else a plain loop: exact, but no faster than float)."""
    return available() and bool(skinny.extension().int8_vnni())


def usable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` [V, H] fits the kernel: float32 on CPU, V a multiple of 16, H of 4."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 4 == 0)


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [V, K] rounded per row to int8: (values [V, K] int8, scales [V] = max|w_v| / 127; 1 for a
    zero row)."""
    scale = w.abs().amax(dim=1) / 127  # [V]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def to_u8(x: torch.Tensor, lo: torch.Tensor,
          hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` rounded to 8 bits over [lo, hi] (which hold 0; tensors broadcasting against ``x``):
    (codes 0..255 as float32, step, zero point), ``x ~ (codes - zero) * step``; an empty range takes step
    1."""
    step = (hi - lo) / 255
    step = torch.where(step > 0, step, torch.ones_like(step))
    zero = torch.round(-lo / step)
    return (torch.round(x / step) + zero).clamp(0, 255), step, zero


class Int8Pass:
    """The int8 pass over ``weight`` [V, H] float32, smoothed by channel scales from ``sample`` [n, H]
    (hidden states the screen has seen)."""

    def __init__(self, weight: torch.Tensor, sample: torch.Tensor, slack: float):
        if not usable(weight):
            raise ValueError(f"the int8 pass needs a float32 CPU weight [V, H] with V % 16 == 0 and H % "
                             f"4 == 0, "
                             f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
        self.ext = skinny.extension()
        peak = sample.detach().abs().amax(dim=0).float()  # [H]
        floor = peak[peak > 0].min() if (peak > 0).any() else torch.ones(())
        s = torch.where(peak > 0, peak, floor).sqrt()  # [H] channel scales
        self.inv_scale = 1.0 / s  # [H]: x' = x * inv_scale
        # [V, H] W' = W * s (float32 rounding: within the slack, see the module's note)
        w = weight * s[None, :]
        q, step = int8_rows(w)  # [V, H], [V]
        self.packed = self.ext.int8_pack(q)  # [V/16, H/4, 16, 4]
        self.colsum = q.sum(dim=1, dtype=torch.int32)  # [V]
        self.step = step  # [V]
        self.norms = _bound_norms(weight, w, q, step)  # [3, V]
        self.slack = slack

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [N, H] finite float32 -> (approximate logits [N, V] float32, bound coefficients [N, 3],
        floor [N]): token v's error is at most ``e_v = coef[r] . norms[:, v]``, and ``floor[r]`` is the
        row's largest ``a_v - e_v``, a lower bound of its float32 maximum."""
        xs = x * self.inv_scale  # [N, H] x'
        # per row over its range, which holds 0 (so the zero point is a code): [N, H], [N, 1], [N, 1]
        codes, xstep, zero = to_u8(xs, xs.amin(dim=1, keepdim=True).clamp(max=0),
                                   xs.amax(dim=1, keepdim=True).clamp(min=0))
        rounded = (codes - zero) * xstep  # [N, H] x~ (exact in float32: small integers times the step)
        up = 1 + 1e-5
        coef = torch.stack([rounded.norm(dim=1) * up, (rounded - xs).norm(dim=1) * up,
                            self.slack * x.norm(dim=1) * up], dim=1).contiguous()  # [N, 3]
        scores, floor = self.ext.int8_scores(codes.to(torch.uint8).contiguous(), xstep.flatten().contiguous(),
                                             zero.flatten().to(torch.int32).contiguous(), self.packed,
                                             self.colsum, self.step, coef, self.norms)
        return scores, coef, floor

    def candidates(self, scores: torch.Tensor, coef: torch.Tensor,
                   floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, tokens) [K] each: per row the tokens whose ``a_v + e_v`` reaches ``floor``: the
        float32 argmax is among them."""
        return tuple(self.ext.bounded_candidates(scores, coef, self.norms, floor))


def _bound_norms(weight: torch.Tensor, smoothed: torch.Tensor, q: torch.Tensor, step: torch.Tensor,
                 chunk: int = 16384) -> torch.Tensor:
    """[3, V] float32, per token: ||W~_v - W'_v||, ||W'_v||, ||W_v||, summed in float64 a chunk of
    rows at a time and rounded up, so that float32 never shrinks a bound."""
    out = torch.empty(3, weight.shape[0], dtype=torch.float64)
    for a in range(0, weight.shape[0], chunk):
        w, ws = weight[a:a + chunk].double(), smoothed[a:a + chunk].double()
        out[0, a:a + chunk] = (q[a:a + chunk].double() * step[a:a + chunk].double()[:, None] - ws).norm(dim=1)
        out[1, a:a + chunk] = ws.norm(dim=1)
        out[2, a:a + chunk] = w.norm(dim=1)
    return (out * (1 + 1e-5)).float().contiguous()


class Int8Race:
    """Whether a greedy screen call of few rows takes the int8 pass: ``mode`` "auto" offers it where
    AVX-512 VNNI runs it, builds it once ``CALIBRATION_ROWS`` rows have been seen (their channel peaks
    smooth it), then times whole calls (pass, candidates, rescoring) of each row count against the
    other passes, ``TRIALS`` each, and keeps the faster; "on" builds it at the first call and always
    takes it (tests); "off" never. ``held`` (set by a cost measurement): none of that happens.
    A measurement's chains start with an arbitrary token, whose flat distribution leaves the int8
    bound thousands of candidates (an 8-row step measured 69 ms with the pass, 34 without), so its
    curve is the other passes'; the engine's steps, cheaper where the pass serves them, correct
    the curve from their own timings (:mod:`logitspec.spec_decode.feedback`)."""

    TRIALS = 3
    CALIBRATION_ROWS = 16

    def __init__(self, weight: torch.Tensor, mode: str, slack: float):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"int8 screen mode must be 'auto', 'on' or 'off', got {mode!r}")
        self.weight, self.mode, self.slack = weight, mode, slack
        self.enabled = mode != "off" and usable(weight) and (fast_here() if mode == "auto" else available())
        self.pass_: Int8Pass | None = None
        self.sample: list[torch.Tensor] = []  # the hidden states seen before the build ([n, H] each)
        self.held = False  # while True (a cost measurement), no call takes the pass, builds it or times it
        self._times: dict[int, dict[bool, list[float]]] = {}  # rows -> int8 or not -> seconds
        self.chosen: dict[int, bool] = {}  # rows -> whether the int8 pass serves them

    @contextlib.contextmanager
    def holding(self):
        """``held`` within the block."""
        self.held = True
        try:
            yield
        finally:
            self.held = False

    def offered(self, x: torch.Tensor) -> bool:
        """Whether a greedy call of ``x`` [N, H] may take the pass (a non-finite row never does)."""
        return (self.enabled and not self.held and len(x) <= MAX_ROWS and x.dtype == torch.float32
                and bool(torch.isfinite(x).all()))

    def choose(self, x: torch.Tensor) -> bool:
        """Whether this call of ``x`` [N, H] takes the int8 pass (building it once calibrated)."""
        if self.pass_ is None:
            self.sample.append(x.detach().clone())
            if sum(map(len, self.sample)) < (1 if self.mode == "on" else self.CALIBRATION_ROWS):
                return False
            self.pass_ = Int8Pass(self.weight, torch.cat(self.sample), self.slack)
            self.sample = []  # its work is done
        if self.mode == "on":
            return True
        if len(x) in self.chosen:
            return self.chosen[len(x)]
        t = self._times.setdefault(len(x), {True: [], False: []})
        return len(t[True]) <= len(t[False])

    def record(self, rows: int, used: bool, seconds: float) -> None:
        """A timed call; after ``TRIALS`` of each kind for ``rows`` rows, keep the faster."""
        t = self._times.get(rows)
        if self.mode == "on" or t is None or rows in self.chosen:
            return
        t[used].append(seconds)
        if min(len(v) for v in t.values()) >= self.TRIALS:
            self.chosen[rows] = min(t[True]) < min(t[False])
            log.debug("int8 screen pass for %d rows: %s (%.2f ms against %.2f)", rows, self.chosen[rows],
                      min(t[True]) * 1e3, min(t[False]) * 1e3)

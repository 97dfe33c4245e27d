"""The graph runner's step compiled by inductor, and the SDPA kernel its steps may use.

A compiled step is the same device work as the uncompiled one (masks from the buffers, the decoder
over the slots, the hidden states into the bucket's output), traced by dynamo as one graph
(``fullgraph``: a break would leave Python between kernels, which a capture cannot hold) with the
bucket's static shapes, and lowered by inductor: elementwise work (norms, rotary, activations,
residual adds, the mask building) fused into a few kernels, the projections left to the vendor
GEMMs. On CUDA the compiled function is what the runner captures in its graph (inductor's own
CUDA graphs stay off: one capture, ours). Each bucket compiles once, when it is built; a compiled
step called again with new inputs in its buffers runs without a recompile (counted:
:meth:`StepCompiler.run`). A compiled step is used only where its output matched the uncompiled
step's on the same buffers at its first real step (:data:`TOLERANCE`): inductor's CPU lowering of flex
attention inside the whole step, for one, gave other hidden states than the same graph run by dynamo
without inductor (torch 2.13), so a compiler's mistake costs speed, never tokens.

The query/key/value and gate/up projections reach it merged at load (one GEMM each:
:mod:`logitspec.models.merged_projections`), not by inductor's frozen-weight patterns, which would
store concatenated copies of those weights per compiled graph.
"""
from __future__ import annotations

import contextlib

import torch

# the SDPA kernels a step may be pinned to (torch.nn.attention.SDPBackend members, by name); flash
# attention takes no mask, so a tree step cannot use it
SDPA_BACKENDS = ("efficient", "cudnn", "math")
_BACKEND_NAMES = {"efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
# steps compiled per dynamo cache entry: each bucket's step is a closure of the same code
RECOMPILE_LIMIT = 1024
# the largest difference from the uncompiled step's output a compiled step may show, relative to the
# output's largest magnitude (fused reductions round differently; a wrong kernel differs by O(1))
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


class CompiledStepMismatch(RuntimeError):
    """A compiled step's output differs from the uncompiled step's."""


def sdpa_context(backend: str | None):
    """A function giving the context in which a step's SDPA calls run: only ``backend``'s kernel
    (an error where it cannot run a call, never a silent fallback), or torch's choice (None)."""
    if backend is None:
        return contextlib.nullcontext
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"sdpa_backend must be one of {', '.join(SDPA_BACKENDS)} or None, got {backend!r}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, _BACKEND_NAMES[backend])
    return lambda: sdpa_kernel([chosen])


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Let dynamo keep ``limit`` compiled versions of one function, and of one code object over all its
    frames (defaults 8 and 256; past either, flex attention runs its unfused eager form and a
    ``fullgraph`` step fails to compile). Gemma 3's buckets alone are 13 x 7 x 2 flex compiles."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for names in (("recompile_limit", "cache_size_limit"),
                  ("accumulated_recompile_limit", "accumulated_cache_size_limit")):  # newer, older name
        name = next((n for n in names if hasattr(cfg, n)), None)
        if name is not None:
            setattr(cfg, name, max(getattr(cfg, name), limit))


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class StepCompiler:
    """Compiles a graph runner's step functions (functions of no arguments reading static buffers)."""

    def __init__(self, mode: str | None = None, backend="inductor"):
        """``mode``: inductor's (None: its default; "max-autotune-no-cudagraphs" tunes GEMM kernels
        at a longer compile). ``backend``: dynamo's (tests)."""
        self.mode, self.backend = mode, backend
        raise_recompile_limit()

    def compile(self, fn) -> tuple[object, int]:
        """``fn`` compiled, and the graphs compiled for it: it runs until a call compiles nothing (the
        compile happens on the first call; a library's state that the first call changes can make the
        second compile again; a step's writes are its own, so running it again changes nothing)."""
        kw = {"mode": self.mode} if self.backend == "inductor" else {}
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=self.backend, **kw)
        total = 0
        for _ in range(3):
            made = self.run(compiled)
            total += made
            if not made and total:
                break
        return compiled, total

    @staticmethod
    def check(fn, step, output: torch.Tensor, decision: torch.Tensor | None = None) -> None:
        """Run the uncompiled ``fn``, then ``step`` (the compiled step, or its graph's replay), on the
        same buffers: :class:`CompiledStepMismatch` unless ``output`` agrees within :data:`TOLERANCE`
        and ``decision`` (a decided step's tokens and accepted nodes) is the same."""
        fn()
        want = output.float().clone()
        decided = None if decision is None else decision.clone()
        step()
        got = output.float()
        err = float((got - want).abs().max()) / float(want.abs().max().clamp(min=1e-6))
        if not err <= TOLERANCE.get(output.dtype, 5e-2):
            raise CompiledStepMismatch(f"its output differs from the uncompiled step's by {err:.3g} of the "
                                       f"output's scale")
        if decided is not None and not torch.equal(decided, decision):
            raise CompiledStepMismatch("its greedy decision differs from the uncompiled step's")

    @staticmethod
    def run(compiled) -> int:
        """Run ``compiled``; the graphs compiled while it ran (0 once its shape is compiled)."""
        before = graphs_compiled()
        compiled()
        return graphs_compiled() - before

"""The decoder's RMS norms in one compiled pass per row (``csrc/rms_norm.cpp``), swapped in where a
probe shows they compute what the model's own module computes.

Transformers' RMSNorm modules (Gemma's ``(1 + w)``, Llama's and Qwen2's ``w``) run about eight
tensor operations per call; a decoding step of Gemma 3 270M calls them 109 times on a few rows each,
4.9 ms of a 52 ms step at 6 rows and 6-9 ms at 24 (``git show 4974864:docs/performance.md``). The kernel
does one pass a row with the same two roundings of the products, the sum of squares in its own fixed order
(so a value may differ from the module's by a unit in the last place; every method of the engine runs the
same model, so outputs stay identical across methods, and each row's result depends on that row
alone).

:func:`use_fused_rms_norms` gives every matching module a subclass of its own class whose forward
calls the kernel for CPU inputs of the weight's dtype (float32 or bfloat16) outside autograd and the
original forward otherwise. A module matches if it has a one-dimensional ``weight``, an epsilon
(``eps`` or ``variance_epsilon``), a forward of one input, and its output on probe rows (normal and
tiny, where the epsilon matters) equals the kernel's with weight offset 0 or 1 to rounding (float32:
a few ulps of the row's largest value; bfloat16, where the kernel rounds once at the end: an ulp of
each value). Anything
else is left alone. Pickled or deep-copied, a module is its original class again (correct, unfused).
"""
from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import nn

from . import skinny

logger = logging.getLogger("logitspec.rms_norm")

PROBE_TOLERANCE = 1e-5  # relative: a few float32 ulps of the normalised values
BF16_PROBE_TOLERANCE = 2.0 ** -7  # relative to each value: one bfloat16 ulp (Llama's module rounds twice)
DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, offset: float, eps: float) -> torch.Tensor:
    """``(x * rsqrt(mean(x^2, -1) + eps)) * (offset + weight)`` for CPU ``x`` [..., D] and ``weight``
    [D], each float32 or bfloat16 (float32 arithmetic; a contiguous result in ``x``'s dtype); needs
    the compiled kernel (:func:`skinny.available`)."""
    return skinny.extension().rms_norm(x, weight, float(offset), float(eps))


def _epsilon(module: nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _one_input(cls: type) -> bool:
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1 and not any(p.kind is p.VAR_POSITIONAL for p in params)


def _looks_like_rms_norm(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return ("RMSNorm" in type(module).__name__ and isinstance(w, nn.Parameter) and w.dim() == 1
            and w.dtype in DTYPES and w.device.type == "cpu" and getattr(module, "bias", None) is None
            and _epsilon(module) is not None and not any(True for _ in module.children())
            and _one_input(type(module)))


def probe_offset(module: nn.Module) -> float | None:
    """The weight offset (0.0 or 1.0) with which the kernel reproduces ``module`` on probe rows,
    or None if neither does."""
    D = module.weight.shape[0]
    g = torch.Generator().manual_seed(D)
    x = torch.randn(4, D, generator=g)
    x[2:] *= 1e-3  # mean(x^2) near the usual epsilons (1e-6): a wrong epsilon shows
    x = x.to(module.weight.dtype)
    with torch.inference_mode():
        ref = module(x)
        for offset in (0.0, 1.0):
            got = rms_norm(x, module.weight, offset, _epsilon(module))
            if ref.shape != got.shape or ref.dtype != got.dtype:
                continue
            err, r = (got.float() - ref.float()).abs(), ref.float().abs()
            bound = (PROBE_TOLERANCE * r.amax(dim=-1, keepdim=True) if x.dtype == torch.float32
                     else BF16_PROBE_TOLERANCE * torch.maximum(r, got.float().abs()))
            if bool((err <= bound).all()):
                return offset
    return None


def _applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == weight.dtype and x.dtype in DTYPES and x.device.type == "cpu"
            and weight.device.type == "cpu" and x.shape[-1:] == weight.shape
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _rebuild(cls: type, state: dict) -> nn.Module:
    """A module of class ``cls`` with the attributes ``state`` (unpickling a fused module)."""
    module = cls.__new__(cls)
    module.__setstate__(state)
    return module


@functools.lru_cache(maxsize=None)
def fused_class(base: type) -> type:
    """A subclass of the RMSNorm module class ``base`` whose forward uses the kernel where it applies."""

    def forward(self, hidden_states):
        if _applies(hidden_states, self.weight):
            return rms_norm(hidden_states, self.weight, self.rms_offset, self.rms_eps)
        return base.forward(self, hidden_states)

    def __reduce_ex__(self, protocol):
        # pickled (or deep-copied) as the original class: this class is made at run time, so no
        # other process could find it by name
        return _rebuild, (base, self.__getstate__())

    return type(f"Fused{base.__name__}", (base,), {
        "forward": forward, "__reduce_ex__": __reduce_ex__, "__module__": __name__,
        "__doc__": f"{base.__name__} computed by logitspec's fused kernel for CPU inputs of its "
                   f"weight's dtype."})


def use_fused_rms_norms(model: nn.Module) -> int:
    """Give every RMSNorm module of ``model`` that the kernel reproduces (see the module docstring)
    the fused forward; the weights stay the modules' own. Returns the count (0 without the kernel)."""
    if not skinny.available():
        return 0
    swapped, refused = 0, set()
    for module in model.modules():
        if type(module).__name__.startswith("Fused") or not _looks_like_rms_norm(module):
            continue
        offset = probe_offset(module)
        if offset is None:
            refused.add(type(module).__name__)
            continue
        module.rms_offset, module.rms_eps = offset, _epsilon(module)  # what the probe matched, read per call
        module.__class__ = fused_class(type(module))
        swapped += 1
    if refused:
        logger.info("RMS norms left to transformers (the kernel did not reproduce them): %s", sorted(refused))
    return swapped

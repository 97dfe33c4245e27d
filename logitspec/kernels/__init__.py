"""CPU kernels for few-row products: :mod:`logitspec.kernels.skinny` (the compiled AVX2 skinny-linear
kernel and its ``nn.Linear`` subclass) and :func:`swap_linears` (puts such a subclass into a model)."""
from .swap import swap_linears

__all__ = ["swap_linears"]

"""LogitSpec: lossless, training-free speculative decoding with logit-guided n-gram draft trees."""
from .config import SpecConfig
from .engine import Engine, GenerationResult

__all__ = ["Engine", "GenerationResult", "SpecConfig", "load_model"]


def load_model(spec: str = "default", **kwargs):
    """Load ``(model, tokenizer)``; see :func:`logitspec.models.load_model`."""
    from .models import load_model as _load

    return _load(spec, **kwargs)

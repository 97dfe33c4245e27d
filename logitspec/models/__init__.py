"""Model loading: built-in GGUF models from PyPI packages, local HF dirs, local GGUF files, HF cache ids.

``paths`` (cache dir and file helpers, a leaf module), ``builtin`` (the built-in models), ``gguf``
(GGUF reading and conversion), ``loading`` (:func:`resolve_model_path`, :func:`load_model`). The public
names are re-exported here.
"""
from logitspec.paths import CACHE_ENV, default_cache_dir

from .builtin import BUILTIN_MODELS
from .errors import InvalidModelFileError, ModelConversionError, ModelNotFoundError
from .gguf import MARKER_FILE
from .loading import load_model, resolve_model_path

__all__ = [
    "ModelNotFoundError",
    "InvalidModelFileError",
    "ModelConversionError",
    "BUILTIN_MODELS",
    "CACHE_ENV",
    "MARKER_FILE",
    "default_cache_dir",
    "resolve_model_path",
    "load_model",
]

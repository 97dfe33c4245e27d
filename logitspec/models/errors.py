"""The errors model loading raises (a leaf module, so every part of the loader can raise them)."""
from __future__ import annotations

__all__ = ["ModelNotFoundError", "InvalidModelFileError", "ModelConversionError"]


class ModelNotFoundError(ValueError):
    """The spec names no model that can be found (or made) locally."""


class InvalidModelFileError(ModelNotFoundError):
    """A model file exists but cannot be a model (a damaged, truncated or foreign ``.gguf``); the message
    names the file and what is wrong. Raised before anything is converted or written."""


class ModelConversionError(RuntimeError):
    """A GGUF file was found but converting it produced something wrong (e.g. a broken tokenizer)."""

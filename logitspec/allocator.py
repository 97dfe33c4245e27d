"""tcmalloc for the processes that run the model, where the machine has it.

glibc's malloc returns a freed large block to the kernel and faults fresh pages in for the next
one, so every step's activations (a few MB each, hundreds of tensors a step) pay page faults;
tcmalloc keeps them. With it preloaded our float32 step at 6 rows took 25-28 ms against 28-32
(24 rows: 43-46 against 45-50; docs/performance.md, "Allocator"); vLLM's CPU backend
preloads it too. It changes no result: allocation only.

A library can only be preloaded when a process starts, so: the ``logitspec`` command re-executes
itself once with it (:func:`reexec_with_tcmalloc`), and the pipeline starts its Ray actors with it
(:func:`preload_env`). Set ``LOGITSPEC_TCMALLOC=0`` to keep the system allocator.
"""
from __future__ import annotations

import os
import sys

ENV = "LOGITSPEC_TCMALLOC"  # "0": never preload; "1" (set by the re-exec): already tried here
CANDIDATES = (  # Debian/Ubuntu's libtcmalloc-minimal4 and libgoogle-perftools4, on x86-64 and arm64
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc.so.4",
)


def library(candidates=CANDIDATES) -> str | None:
    """The first tcmalloc of ``candidates`` on this machine, or None."""
    return next((p for p in candidates if os.path.exists(p)), None)


def loaded(maps: str = "/proc/self/maps") -> bool:
    """Whether tcmalloc is mapped into this process."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            return any("tcmalloc" in line for line in f)
    except OSError:
        return False


def preloads(env) -> list[str]:
    """The libraries ``env``'s ``LD_PRELOAD`` names (colon- or space-separated)."""
    return [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]


def preload_env(env: dict | None = None, candidates=CANDIDATES) -> dict:
    """Environment variables to add for a new process so that it runs on tcmalloc: ``{"LD_PRELOAD":
    ...}`` (after any preload ``env`` has), or ``{}`` when there is none here or it is switched off."""
    env = os.environ if env is None else env
    lib = library(candidates)
    if lib is None or env.get(ENV) == "0":
        return {}
    have = preloads(env)
    if any("tcmalloc" in p for p in have):
        return {}
    return {"LD_PRELOAD": ":".join(have + [lib])}


def reexec_with_tcmalloc() -> None:
    """Replace this process by itself (the interpreter's own command line, ``-m`` included) with
    tcmalloc preloaded, once; returns (doing nothing) when it is loaded already, absent, switched
    off or already tried."""
    if os.environ.get(ENV) in ("0", "1") or loaded():
        return
    extra = preload_env()
    if not extra:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **extra, ENV: "1"})

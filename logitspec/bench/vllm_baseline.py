"""vLLM's CPU backend as a throughput baseline, run in its own virtual environment and process.

vLLM's CPU build pins its own torch, so it lives in a separate environment (default
``~/.cache/logitspec/vllm-venv``, see docs/performance.md for the install). For each vLLM method this
module starts :mod:`logitspec.bench.vllm_runner` with that environment's python (both cores bound
to its OpenMP threads, tcmalloc preloaded when installed) as a resident :class:`Runner`, which runs
measured rounds on demand: :func:`logitspec.bench.throughput.run` alternates them with its own.
"""
from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import pathlib
import queue
import subprocess
import sys
import tempfile
import threading
import time

from .. import allocator
from . import vllm_runner

METHODS = tuple(vllm_runner.SPECULATIVE)  # plain, ngram, suffix
RUNNER = pathlib.Path(vllm_runner.__file__)


def default_python() -> pathlib.Path:
    from logitspec.paths import default_cache_dir

    return default_cache_dir() / "vllm-venv" / "bin" / "python"


def find_python(path=None) -> tuple[pathlib.Path | None, str]:
    """The python of vLLM's environment (``path`` or :func:`default_python`), or None and why not."""
    py = pathlib.Path(path).expanduser() if path else default_python()
    if not py.is_file():
        return None, (f"vLLM baseline skipped: no python at {py} (install vLLM's CPU build into its own "
                      "environment, see docs/performance.md, or pass --vllm-python)")
    site = glob.glob(str(py.parent.parent / "lib" / "python*" / "site-packages" / "vllm" / "__init__.py"))
    if not site and path is None:
        return None, f"vLLM baseline skipped: {py}'s environment has no vllm package"
    return py, ""


def parse_methods(text: str) -> list[str]:
    """``plain,ngram`` -> the vLLM methods; ValueError naming the known ones on a typo."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"unknown vLLM methods {bad or text!r}; known: {', '.join(METHODS)}")
    return methods


def runner_env(python: pathlib.Path, threads: int) -> dict[str, str]:
    """The runner's environment: vLLM's CPU settings for ``threads`` cores, and tcmalloc plus the
    environment's Intel OpenMP preloaded where present (vLLM's CPU backend asks for both), after
    what ``LD_PRELOAD`` holds already (ours, run on tcmalloc, holds only that)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")  # the default keeps a core idle
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, per resident runner
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    have = allocator.preloads(env)
    tcmalloc = None if any("tcmalloc" in p for p in have) else allocator.library()
    preload = [p for p in (tcmalloc,
                           *sorted(glob.glob(str(python.parent.parent / "lib" / "libiomp5.so")))[:1])
               if p and p not in have]
    if have or preload:
        env["LD_PRELOAD"] = ":".join(have + preload)
    env.pop("PYTHONPATH", None)  # our tree must not shadow the environment's packages
    return env


class Runner:
    """One resident vLLM engine (a method, a dtype, at most ``max_num_seqs`` rows running) in a child
    process with vLLM's python; :meth:`round` runs one measured round there on demand, so its rounds
    can alternate with ours. Start-up (engine and warm-up, not measured) happens in the constructor;
    RuntimeError with the child's last output if it fails, TimeoutError after ``timeout`` seconds
    without an answer. Close it (or use it as a context manager) to end the child."""

    def __init__(self, python, model_dir, method: str, max_new_tokens: int, max_num_seqs: int,
                 warmup: list[int], threads: int = 2, dtype: str = "float32",
                 max_model_len: int | None = None, timeout: float = 1800):
        self.method, self._timeout, self._rounds = method, timeout, 0
        self._tmp = tempfile.TemporaryDirectory(prefix="logitspec-vllm-")
        self._lines: queue.Queue = queue.Queue()
        self._tail: collections.deque = collections.deque(maxlen=80)
        req = pathlib.Path(self._tmp.name, "request.json")
        req.write_text(json.dumps({"model": str(model_dir), "method": method, "dtype": dtype,
                                   "max_new_tokens": max_new_tokens, "max_num_seqs": max_num_seqs,
                                   "warmup": list(warmup), "reply": str(req.with_name("ready.json")),
                                   **({"max_model_len": max_model_len} if max_model_len else {})}))
        python = pathlib.Path(python)
        self._proc = subprocess.Popen([str(python), str(RUNNER), str(req)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=runner_env(python, threads), cwd=self._tmp.name)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.engine_init_s = float(self._await(req.with_name("ready.json"))["engine_init_s"])
        except BaseException:
            self.close()
            raise

    def round(self, batch_size: int, prompts: list[list[int]], slots: bool = False) -> dict:
        """``prompts`` at batch size ``batch_size`` (groups of b, or all at once with ``slots``: vLLM
        keeps ``max_num_seqs`` running): the runner's record, ``{"tokens", "wall_s", "tokens_per_s",
        "token_ids"}``."""
        self._rounds += 1
        reply = pathlib.Path(self._tmp.name, f"round-{self._rounds}.json")
        try:
            self._proc.stdin.write(json.dumps({"batch_size": batch_size, "prompts": prompts, "slots": slots,
                                               "reply": str(reply)}) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._failed()
        return self._await(reply)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write("\n")  # the runner's end of rounds
                self._proc.stdin.close()
                self._proc.wait(timeout=120)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # the child closed its output: it has ended

    def _await(self, reply: pathlib.Path) -> dict:
        """Wait for the runner's ``MARK reply`` line (keeping its other output for errors); the reply."""
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"vLLM runner ({self.method}) gave no answer in {self._timeout:.0f} s") from None
            if line is None:
                self._failed()
            if line.startswith(vllm_runner.MARK) and line.split(maxsplit=1)[1].strip() == str(reply):
                return json.loads(reply.read_text())
            self._tail.append(line)

    def _failed(self):
        code = self._proc.wait()
        raise RuntimeError(f"vLLM runner ({self.method}) failed with exit code {code}:\n"
                           + "".join(self._tail)[-3000:])


def start_runners(python, model_dir, methods, batch_sizes, max_new_tokens: int, warmup: list[int],
                  stack: contextlib.ExitStack, threads: int = 2, slots: bool = False, dtype: str = "float32",
                  max_model_len: int | None = None, log=print) -> dict[tuple[str, int], "Runner"]:
    """A resident :class:`Runner` per vLLM method (per method and batch size with ``slots``: vLLM's
    row limit is fixed at start-up), entered into ``stack``: ``{("vllm-<method>", b): runner}``. A
    method whose engine fails to start is reported on stderr and left out (the rest stands)."""
    runners = {}
    for m in methods:
        for group in ([[b] for b in batch_sizes] if slots else [list(batch_sizes)]):
            log(f"vLLM {m}: starting in {python} ...")
            try:
                r = stack.enter_context(Runner(python, model_dir, m, max_new_tokens, max(group), warmup,
                                               threads, dtype, max_model_len))
            except (RuntimeError, TimeoutError, OSError) as e:
                print(f"vLLM {m} skipped: {e}", file=sys.stderr)
                break
            log(f"vLLM {m}: engine start-up {r.engine_init_s:.0f} s (not in tokens/s)")
            runners.update({(f"vllm-{m}", b): r for b in group})
    return runners

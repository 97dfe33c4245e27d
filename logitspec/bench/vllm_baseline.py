"""vLLM's CPU backend as a throughput baseline, run in its own virtual environment and process.

vLLM's CPU build pins its own torch, so it lives in a separate environment (default
``~/.cache/logitspec/vllm-venv``, see docs/performance.md for the install). For each vLLM method this
module writes a request, runs :mod:`logitspec.bench.vllm_runner` with that environment's python
(both cores bound to its OpenMP threads, tcmalloc preloaded when installed), and reads the runner's
result back into rows of :func:`logitspec.bench.throughput.run`'s table.
"""
from __future__ import annotations

import glob
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from . import vllm_runner

METHODS = tuple(vllm_runner.SPECULATIVE)  # plain, ngram, suffix
RUNNER = pathlib.Path(vllm_runner.__file__)
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


def default_python() -> pathlib.Path:
    from ..models.paths import default_cache_dir

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
    environment's Intel OpenMP preloaded where present (vLLM's CPU backend asks for both)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")  # the default keeps a core idle
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    root = python.parent.parent
    preload = [p for p in TCMALLOC if os.path.exists(p)][:1]
    preload += sorted(glob.glob(str(root / "lib" / "libiomp5.so")))[:1]
    if preload and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = ":".join(preload)
    env.pop("PYTHONPATH", None)  # our tree must not shadow the environment's packages
    return env


def run_method(python: pathlib.Path, model_dir, method: str, prompts: dict[int, list[list[int]]],
               max_new_tokens: int, rounds: int, warmup: list[int], threads: int = 2,
               timeout: float = 1800, max_model_len: int | None = None, slots: bool = False,
               dtype: str = "float32") -> dict:
    """Run one vLLM method on token-id ``prompts`` (batch size -> its prompts) in a child process;
    its result as :func:`read_result` gives it. RuntimeError with the child's last output if it fails.
    ``max_model_len``: vLLM's context (the runner's default is 2,048 tokens). ``slots``: each batch
    size's prompts in one ``generate`` call, vLLM keeping that many running (refilled as rows
    finish); ``prompts`` must then hold one batch size (vLLM's limit is set at start-up). ``dtype``:
    the model's ("float32" or "bfloat16")."""
    if slots and len(prompts) != 1:
        raise ValueError(f"slots: one batch size per vLLM run, got {sorted(prompts)}")
    python = pathlib.Path(python)
    with tempfile.TemporaryDirectory(prefix="logitspec-vllm-") as tmp:
        req, out = pathlib.Path(tmp, "request.json"), pathlib.Path(tmp, "result.json")
        req.write_text(json.dumps({"model": str(model_dir), "method": method, "dtype": dtype,
                                   "prompts": {str(b): p for b, p in prompts.items()},
                                   "max_new_tokens": max_new_tokens, "rounds": rounds, "warmup": warmup,
                                   "slots": slots,
                                   **({"max_model_len": max_model_len} if max_model_len else {})}))
        proc = subprocess.run([str(python), str(RUNNER), str(req), str(out)], env=runner_env(python, threads),
                              capture_output=True, text=True, timeout=timeout, cwd=tmp)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"vLLM runner ({method}) failed with exit code {proc.returncode}:\n{tail}")
        return read_result(out.read_text())


def read_result(text: str) -> dict:
    """The runner's JSON -> ``{"method", "engine_init_s", "batches": {b: {"tokens_per_s": median
    over rounds, "rounds": [tokens/s], "token_ids": the last round's outputs}}}``; ValueError if
    the record is not the runner's."""
    try:
        rec = json.loads(text)
        batches: dict[int, dict] = {}
        for run in rec["runs"]:
            row = batches.setdefault(int(run["batch_size"]), {"rounds": [], "token_ids": None})
            row["rounds"].append(float(run["tokens"]) / float(run["wall_s"]))
            row["token_ids"] = [[int(t) for t in ids] for ids in run["token_ids"]]
        method, init = str(rec["method"]), float(rec["engine_init_s"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ValueError(f"not a vLLM runner result: {e!r}") from None
    for row in batches.values():
        row["tokens_per_s"] = statistics.median(row["rounds"])
    return {"method": method, "engine_init_s": init, "batches": batches}


def table_rows(result: dict, ours: dict) -> dict:
    """Rows ``vllm-<method>@<b>`` for the throughput table, against our ``ar`` rows in ``ours``
    (``vs_ar``; ``same_as_ar`` when ``ours`` carries ``ar``'s outputs)."""
    rows = {}
    for b, r in sorted(result["batches"].items()):
        ar = ours.get(f"ar@{b}") or {}
        base, ar_ids = ar.get("tokens_per_s"), ar.get("token_ids")
        rows[f"vllm-{result['method']}@{b}"] = {
            "method": f"vllm-{result['method']}", "batch_size": b, "tokens_per_s": r["tokens_per_s"],
            "vs_ar": r["tokens_per_s"] / base if base else None, "mat": None,
            "same_as_ar": r["token_ids"] == ar_ids if ar_ids is not None else None, "rounds": r["rounds"],
        }
    return rows


def run_all(python, model_dir, methods, prompts, max_new_tokens, rounds, warmup, ours: dict,
            threads: int = 2, log=print, slots: bool = False, dtype: str = "float32") -> dict:
    """:func:`run_method` for each of ``methods``, as table rows; a failing method is reported and
    skipped (the rest of the table stands). ``slots``: each batch size runs as a job of its own
    (one vLLM start-up per batch size, see :func:`run_method`)."""
    rows = {}
    groups = [{b: p} for b, p in prompts.items()] if slots else [prompts]
    for m in methods:
        for group in groups:
            log(f"vLLM {m}: running in {python} ...")
            try:
                result = run_method(python, model_dir, m, group, max_new_tokens, rounds, warmup, threads,
                                    slots=slots, dtype=dtype)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
                print(f"vLLM {m} skipped: {e}", file=sys.stderr)
                break
            log(f"vLLM {m}: engine start-up {result['engine_init_s']:.0f} s (not in tokens/s)")
            rows.update(table_rows(result, ours))
    return rows

"""tcmalloc for the processes that run the model (logitspec.allocator): found, preloaded, switched off."""
from __future__ import annotations

import os
import subprocess
import sys

from logitspec import allocator
from pipeline.replica import faults
from pipeline.replica.actor_env import QUIET_BARS, actor_runtime_env

PROBE = ("import os; from logitspec import allocator; allocator.reexec_with_tcmalloc(); "
         "print(allocator.loaded(), os.environ.get('LOGITSPEC_TCMALLOC'))")


def test_preload_env_adds_the_library_once_and_can_be_switched_off(tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    found = (str(tmp_path / "absent.so"), str(lib))
    assert allocator.library(found) == str(lib) and allocator.library(found[:1]) is None
    assert allocator.preload_env({}, found) == {"LD_PRELOAD": str(lib)}
    merged = {"LD_PRELOAD": f"/x/libiomp5.so:{lib}"}
    assert allocator.preload_env({"LD_PRELOAD": "/x/libiomp5.so"}, found) == merged
    assert allocator.preload_env({"LD_PRELOAD": str(lib)}, found) == {}  # there already
    assert allocator.preload_env({"LOGITSPEC_TCMALLOC": "0"}, found) == {}
    assert allocator.preload_env({}, found[:1]) == {}  # none on this machine


def test_a_command_reexecutes_itself_on_tcmalloc_once():
    """The real re-exec in a child python (``-c`` kept by ``sys.orig_argv``): tcmalloc mapped in where
    the machine has it, and the marker that stops a second re-exec; nothing with it switched off."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == (["True", "1"] if allocator.library() else ["False", "None"])
    off = subprocess.run([sys.executable, "-c", PROBE], env={**env, allocator.ENV: "0"}, capture_output=True,
                         text=True, check=True).stdout
    assert off.split() == ["False", "0"]


def test_actors_get_the_fault_variable_and_the_preload(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(allocator.ENV, raising=False)
    monkeypatch.setenv(faults.ENV, "row:7")
    for name in QUIET_BARS:
        monkeypatch.delenv(name, raising=False)
    got = actor_runtime_env()["env_vars"]
    assert got == {faults.ENV: "row:7", **allocator.preload_env(), **QUIET_BARS}
    monkeypatch.delenv(faults.ENV)
    monkeypatch.setenv(allocator.ENV, "0")
    assert actor_runtime_env() == {"env_vars": QUIET_BARS}  # progress bars off in actors' log files
    monkeypatch.setenv("TQDM_DISABLE", "0")  # unless the user says otherwise
    assert actor_runtime_env() == {"env_vars": {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}}

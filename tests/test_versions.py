"""The tested torch and transformers releases: pyproject.toml's bounds, and the engine, the job and the
device check refusing anything outside them in one line before any work (transformers 5.17-5.18 ignore
the engine's ``cache=`` without a word)."""
import re
import sys

import pytest
import torch
from conftest import REPO
from tiny_models import tiny_model

from logitspec import Engine, versions
from logitspec.versions import TESTED, UnsupportedVersion, check_versions, release

OLD = {"torch": torch.__version__, "transformers": "5.18.0"}


def test_the_tested_range_is_pyprojects():
    text = (REPO / "pyproject.toml").read_text()
    for name, (low, high) in TESTED.items():
        assert re.search(rf'"{name}>={re.escape(low)},<{re.escape(high)}"', text), name


def test_versions_outside_the_range_are_refused_in_one_line():
    assert release("2.11.0+cu130") == (2, 11, 0) and release("5.25.0.dev0") == (5, 25, 0)
    check_versions({"torch": "2.11.0+cu130", "transformers": "5.24.0"})  # the lent machine's, with wheels
    new_torch = {"torch": "2.15.0", "transformers": "5.25.0"}
    for found, bad in ((OLD, "transformers 5.18.0"), (new_torch, "torch 2.15.0")):
        with pytest.raises(UnsupportedVersion) as e:
            check_versions(found)
        assert bad in str(e.value) and "\n" not in str(e.value)
    check_versions()  # this machine's


def test_the_engine_refuses_an_untested_transformers(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda: OLD)
    with pytest.raises(UnsupportedVersion, match="transformers 5.18.0"):
        Engine(tiny_model("llama"))


def test_the_job_refuses_before_ray_starts(monkeypatch, capsys, tmp_path):
    from pipeline.job.cli import main

    monkeypatch.setattr(versions, "installed", lambda: OLD)
    rc = main(["--input", str(REPO / "data" / "demo" / "prompts.jsonl"), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: unsupported transformers 5.18.0") and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_the_device_check_refuses_an_untested_transformers(monkeypatch, capsys, tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check

    monkeypatch.setattr(versions, "installed", lambda: OLD)
    assert gpu_check.main(["--out", str(tmp_path), "--tiny", "--device", "cpu"]) == 2
    assert "unsupported transformers 5.18.0" in capsys.readouterr().err and not list(tmp_path.iterdir())

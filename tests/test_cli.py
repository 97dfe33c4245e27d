"""The one ``logitspec`` command: every program a user runs is a subcommand with a description, and the
pipeline's subcommands take exactly the flags of their ``jobs/*.py`` entry points (the same parser)."""
import os
import pathlib
import subprocess
import sys

import pytest

from logitspec.cli import PIPELINE_COMMANDS, main

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = {"job": "generate.py", "eval": "eval.py", "build-index": "build_index.py"}


def test_help_lists_every_subcommand_each_with_a_description(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    listed = capsys.readouterr().out.split("positional arguments:", 1)[1].split("options:", 1)[0]
    names = {line.split()[0] for line in listed.splitlines() if line.startswith("    ") and line[4] != " "}
    engine = {"generate", "bench", "calibrate", "throughput", "trace", "analyses", "rest-build"}
    assert names == engine | set(PIPELINE_COMMANDS)
    for name in sorted(names):
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        usage, description = capsys.readouterr().out.split("\n\n")[:2]
        assert usage.startswith(f"usage: logitspec {name}")
        assert not description.startswith(("positional arguments",
                                           "options")), f"logitspec {name}: no description"


def test_the_library_imports_no_ray_and_no_pipeline():
    code = ("import sys, logitspec, logitspec.cli; logitspec.cli.build_parser(); "
            "print([m for m in sys.modules if m.split('.')[0] in ('ray', 'pipeline')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("command", sorted(SCRIPTS))
def test_pipeline_subcommand_has_the_flags_of_its_jobs_script(command, capsys, monkeypatch):
    """``logitspec job --help`` is ``jobs/generate.py --help`` (and so on), but for the program's name."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    ours = capsys.readouterr().out
    script = f"jobs/{SCRIPTS[command]}"
    theirs = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "COLUMNS": "100"}, check=True).stdout
    assert ours.startswith(f"usage: logitspec {command} ") and theirs.startswith(f"usage: {script} ")
    # the usage line wraps by the program's name; everything after it is the same text
    assert ours.split("\n\n", 1)[1] == theirs.split("\n\n", 1)[1]
    assert "--output" in ours


def test_pipeline_subcommand_errors_are_its_own(capsys):
    """A bad flag is reported by the subcommand's own parser (exit 2), not by the top-level one."""
    with pytest.raises(SystemExit) as e:
        main(["job", "--input", "x"])
    assert e.value.code == 2
    assert "logitspec job: error: the following arguments are required: --output" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "hello", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err

"""What a user meets at the ``logitspec`` command line: ``generate`` refuses bad sampling values before
loading a model and prints each generation under a header with a statistics line; ``report`` writes a
finished job's run report; every flag of every parser has help text and shows its default."""
from __future__ import annotations

import argparse

import pytest
from test_run_report import ROWS, write_output
from tiny_models import save_tiny_text_model

import logitspec.models
from logitspec.cli import main


@pytest.mark.parametrize("flags", [["--top-p", "0.5"], ["--top-k", "4"], ["--num-samples", "2"],
                                   ["--temperature", "-1"], ["--max-new-tokens", "0"]])
def test_generate_refuses_bad_sampling_before_loading_the_model(flags, monkeypatch, capsys):
    def load_model(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(logitspec.models, "load_model", load_model)
    assert main(["generate", "hello", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1


def test_generate_separates_prompts_and_prints_statistics(tmp_path, capsys):
    save_tiny_text_model(tmp_path / "m")
    assert main(["generate", "the license", "the classic", "--model", str(tmp_path / "m"),
                 "--max-new-tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [k for k, line in enumerate(lines) if line.startswith("=== prompt ")]
    assert [lines[k] for k in heads] == ["=== prompt 1/2 ===", "=== prompt 2/2 ==="]
    stats = [line for line in lines if line.startswith("[") and "tok/s" in line]
    assert len(stats) == 2 and all("MAT" in s and "accepted draft tokens" in s for s in stats)


def test_report_subcommand_writes_the_report(tmp_path, capsys):
    out = write_output(tmp_path / "out", ROWS[:4])
    assert main(["report", str(out)]) == 0
    assert (out / "_report.md").exists()
    assert capsys.readouterr().out.strip() == str(out / "_report.md")
    assert main(["report", str(tmp_path)]) == 2


def test_help_lists_the_new_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for name in ("report", "analyses", "rest-build"):
        assert f"    {name} " in text


def _parsers():
    """Every parser a user meets: the job's, the sweep's, build-index's and the engine's subcommands."""
    from logitspec.cli import build_parser
    from pipeline.io.build_index import build_parser as index_parser
    from pipeline.job.cli import build_parser as job_parser
    from pipeline.sweep.cli import build_parser as sweep_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    engine = {f"logitspec {name}": p for name, p in sub.choices.items() if name in ENGINE_COMMANDS}
    trace = next(a for a in sub.choices["trace"]._actions if isinstance(a, argparse._SubParsersAction))
    engine.update({f"logitspec trace {name}": p for name, p in trace.choices.items()})
    return {"job": job_parser(), "eval": sweep_parser(), "build-index": index_parser(), **engine}


ENGINE_COMMANDS = ("generate", "bench", "calibrate", "throughput", "analyses", "rest-build")


def test_every_flag_has_help_and_shows_its_default():
    problems = []
    for name, parser in _parsers().items():
        assert parser.description, f"{name}: no description"
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                problems.append(f"{flag}: no help")
                continue
            text = formatter._expand_help(action)
            if action.required and "(default: None)" in text:
                problems.append(f"{flag}: required, shows (default: None)")
            shown = action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0
            if shown and action.option_strings and "default" not in text.lower():
                problems.append(f"{flag}: default {action.default!r} not shown")
        method = next((a for a in parser._actions if "--method" in a.option_strings), None)
        if method is not None and not all(f"{m}:" in (method.help or "") for m in method.choices):
            problems.append(f"{name} --method: does not say what each method is")
    assert not problems, "\n".join(problems)

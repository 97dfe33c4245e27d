"""Chat on any model: a job whose prompts need a chat template (``--messages-column``, ``--chat``) that the
model's tokenizer lacks is refused in one line before Ray starts; ``--chat-template FILE|STRING`` gives one
(the run itself: tests/test_pipeline.py, ``test_a_chat_template_given_to_the_job_is_applied``)."""
import json
import pathlib
import sys

import pytest
from tiny_models import save_tiny_text_model

from pipeline.errors import ConfigError
from pipeline.io.model import has_chat_template, read_chat_template
from pipeline.job.cli import main

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> str:
    """A tiny text model whose tokenizer has no chat template."""
    path = tmp_path_factory.mktemp("tiny-no-template")
    save_tiny_text_model(path, chat_template=False)
    return str(path)


@pytest.fixture
def chat_rows(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"id": i, "messages": [{"role": "user", "content": f"Name colour {i}."}]} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_template_option_takes_a_file_or_the_template_itself(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert read_chat_template(str(f)) == TEMPLATE and read_chat_template(TEMPLATE) == TEMPLATE
    assert read_chat_template(None) is None
    with pytest.raises(ConfigError, match="no file 'missing.jinja'"):
        read_chat_template("missing.jinja")


def test_a_saved_tokenizer_says_whether_it_has_a_template(plain_model, tmp_path):
    assert not has_chat_template(pathlib.Path(plain_model))
    save_tiny_text_model(tmp_path, chat_template=True)
    assert has_chat_template(tmp_path)


def _refused(args, capsys) -> str:
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    return err


def test_chat_without_a_template_is_refused_before_ray_starts(plain_model, chat_rows, tmp_path, capsys):
    out = tmp_path / "out"
    err = _refused(["--input", str(chat_rows), "--output", str(out), "--model", plain_model,
                    "--messages-column", "messages"], capsys)
    assert "has no chat template" in err and "--chat-template FILE|STRING" in err and not out.exists()
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"id": 0, "prompt": "Hello"}) + "\n")
    err = _refused(["--input", str(text), "--output", str(out), "--model", plain_model, "--chat"], capsys)
    assert "has no chat template" in err and not out.exists()


def test_a_chat_template_lets_the_same_job_plan(plain_model, chat_rows, tmp_path, capsys):
    """With ``--chat-template`` (a file) the refused job plans (``--dry-run``: every row to generate, none
    rejected); a template that names no file is refused in one line."""
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    base = ["--input", str(chat_rows), "--output", str(tmp_path / "out"), "--model", plain_model,
            "--messages-column", "messages"]
    assert main(base + ["--chat-template", str(f), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["rows_to_generate"] == 3 and plan["rejected_rows"]["count"] == 0
    assert "--chat-template: no file" in _refused(base + ["--chat-template", "nope.jinja"], capsys)


@pytest.mark.slow
def test_the_embedded_model_without_a_template_is_refused(chat_rows, tmp_path, capsys):
    """The embedded Gemma 3 270M (a base model: no chat template) with a messages column: refused in one
    line, before Ray starts."""
    err = _refused(["--input", str(chat_rows), "--output", str(tmp_path / "out"), "--messages-column",
                    "messages"], capsys)
    assert "model 'default': its tokenizer has no chat template" in err


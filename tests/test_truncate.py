"""``--truncate``: prompts longer than the model's context on the LongBench-format rows of
``data/longbench_local`` (about 3.8k tokens each) and a 128-token tiny model: an error row naming the
prompt's length (``error``), or the prompt cut to the room ``max_new_tokens`` leaves, keeping its end
(``left``) or both ends (``middle``); the output says which rows were cut and how many tokens were kept."""
import json

import pytest
from conftest import REPO
from job_specs import job_spec
from tiny_models import save_tiny_text_model

from logitspec import Engine
from logitspec.evaluation.prompts import format_prompt
from logitspec.models import load_model
from pipeline.replica.worker import RowGenerator, truncate_tokens
from pipeline.rows import InputRow

NEW = 8


def longbench_prompts() -> list[str]:
    """The first row of each data set of data/longbench_local, as its template fills it."""
    out = []
    for f in sorted((REPO / "data" / "longbench_local").glob("*.jsonl")):
        row = json.loads(f.read_text().splitlines()[0])
        out.append(format_prompt(f.stem, row["context"], row["input"]))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-text-llama")
    save_tiny_text_model(path, max_positions=128)
    return load_model(str(path))


def _rows():
    return [InputRow(i, p) for i, p in enumerate(longbench_prompts() + ["A short prompt"])]


def _generator(tiny, how):
    model, tok = tiny
    spec = job_spec(max_new_tokens=NEW, budget="fixed", warmup=False, truncate=how)
    return RowGenerator(Engine(model, tok, spec.engine), spec)


def test_error_mode_refuses_long_prompts_naming_their_length(tiny):
    gen = _generator(tiny, "error")
    full = [len(gen.engine.encode(r.prompt, fit_context=False)) for r in _rows()]
    out, _ = gen(_rows())
    assert all(n > 128 for n in full[:-1])
    for row, n in zip(out[:-1], full):
        assert row.error.startswith(f"prompt has {n} tokens; the model's context is 128")
        assert "--truncate" in row.error and row.n_prompt_tokens == n and row.generation is None
    assert out[-1].error is None and out[-1].truncated is False


@pytest.mark.parametrize("how", ["left", "middle"])
def test_long_prompts_are_cut_to_fit_and_say_so(tiny, how):
    gen = _generator(tiny, how)
    rows = _rows()
    keep = 128 - NEW
    _, prompts = gen.prepare(rows)
    for q, r in zip(prompts[:-1], rows):
        full = gen.engine.encode(r.prompt, fit_context=False)
        want = full[-keep:] if how == "left" else full[:keep // 2] + full[-(keep - keep // 2):]
        assert q.ids == want and q.truncated
    out, _ = gen(rows)
    assert all(r.error is None and r.truncated and r.n_prompt_tokens == keep for r in out[:-1])
    assert out[-1].truncated is False and out[-1].n_prompt_tokens < keep
    assert all(r.n_new_tokens == NEW or r.finish_reason == "stop" for r in out)  # the answer had room


def test_truncate_tokens():
    ids = list(range(10))
    assert truncate_tokens(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate_tokens(ids, 5, "middle") == [0, 1, 7, 8, 9]
    assert truncate_tokens(ids, 12, "middle") == ids
    with pytest.raises(ValueError):
        truncate_tokens(ids, 4, "right")

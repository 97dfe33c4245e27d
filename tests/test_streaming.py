"""pipeline.replica.streaming.StreamingRows: tasks of rows through one engine session, without Ray.

The tiny text model has a 128-token context, so a long prompt leaves room for only a few new tokens
while a short one runs to ``max_new_tokens``: rows of very different lengths, as in a real job.
"""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from job_specs import job_spec
from tiny_models import save_tiny_text_model

from pipeline.rows import InputRow

SHORT = ["Hello there", "Lorem ipsum", "The quick brown fox", "Name a colour", "Once upon a time"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from logitspec.models import load_model

    path = tmp_path_factory.mktemp("tiny-text-llama")
    save_tiny_text_model(path)
    model, tok = load_model(str(path))
    return str(path), model, tok


def _long(tok, words: int) -> str:
    """A prompt of about 125 - ``words`` tokens' room: it leaves few new tokens in the 128 context."""
    text = "the cat sat on the mat " * 40
    ids = tok(text).input_ids[:words]
    return tok.decode(ids)


def _generators(tiny, **kw):
    from logitspec import Engine
    from pipeline.replica.streaming import StreamingRows
    from pipeline.replica.worker import RowGenerator

    path, model, tok = tiny
    spec = job_spec(model=path, max_new_tokens=40, max_batch_size=3, budget="fixed", warmup=False, **kw)
    per_task = RowGenerator(Engine(model, tok, spec.engine), spec)
    stream = StreamingRows(RowGenerator(Engine(model, tok, spec.engine), spec))
    return spec, per_task, stream


def _tasks(tok):
    """Two tasks; the first: one long-running row and rows that stop early (long prompts), one refused."""
    a = [InputRow("a0", SHORT[0])] + [InputRow(f"a{i}", _long(tok, 118 - i)) for i in (1, 2, 3)]
    a.append(InputRow("a4", "   "))  # refused at encode: an error row, the others go on
    b = [InputRow(f"b{i}", p) for i, p in enumerate(SHORT[1:])]
    return a, b


def _key(rows):
    return [(r.id, r.sample, r.generation, r.finish_reason, r.n_new_tokens, r.error) for r in rows]


def test_rows_of_the_next_task_fill_slots_freed_by_the_current_one(tiny):
    """Task b is queued while task a runs: b's rows enter slots freed by a's early-stopping rows before
    a finishes, so the engine runs fuller than task by task; every task gets exactly its own rows,
    in input order, with the generations of the per-task path (greedy: the engine's own output)."""
    _, per_task, stream = _generators(tiny)
    a, b = _tasks(tiny[2])
    ta, tb = stream.put(a), stream.put(b)
    out_a, stats_a = stream.wait(ta)
    assert tb.submitted > 0 and any(x is not None for res in tb.results for x in res), \
        "b's rows were admitted (and some finished) while a was still decoding"
    out_b, stats_b = stream.wait(tb)
    ref_a, sa = per_task(a)
    ref_b, sb = per_task(b)
    assert _key(out_a) == _key(ref_a) and _key(out_b) == _key(ref_b)
    assert [r.id for r in out_a] == [r.id for r in a] and out_a[-1].error == "empty prompt"
    assert min(r.n_new_tokens for r in out_a[1:4]) < 12 < out_a[0].n_new_tokens == 40  # mixed lengths
    # occupancy: the same rows in fewer decoding steps, more rows per step
    steps = stats_a["engine"]["batch_steps"] + stats_b["engine"]["batch_steps"]
    active = stats_a["engine"]["active_sum"] + stats_b["engine"]["active_sum"]
    per_task_steps = sa["engine"]["batch_steps"] + sb["engine"]["batch_steps"]
    per_task_active = sa["engine"]["mean_active"] * sa["engine"]["batch_steps"] \
        + sb["engine"]["mean_active"] * sb["engine"]["batch_steps"]
    # about the same row-steps of work (drafts depend on the batch size, so a row's steps may differ) ...
    assert active == pytest.approx(per_task_active, rel=0.1)
    assert steps < per_task_steps and active / steps > per_task_active / per_task_steps  # ... in fuller steps
    assert stats_a["engine"]["tokens"] == sum(r.n_new_tokens or 0 for r in out_a)


def test_sampled_samples_equal_the_per_task_path_from_concurrent_callers(tiny):
    """Two threads call at once (as a threaded actor's tasks do), rows with 3 samples and a row asking
    for samples [1, 2] only (a resume): each caller gets its own rows, each (id, sample) once, drawn
    exactly as the per-task path draws them for the same seeds."""
    _, per_task, stream = _generators(tiny, temperature=0.8, top_p=0.95, seed=11)
    a, b = _tasks(tiny[2])
    a = [replace(r, samples=(0, 1, 2)) for r in a]
    b = [replace(r, samples=(0, 1, 2)) for r in b[:3]] + [replace(b[3], samples=(1, 2))]
    got: dict = {}
    threads = [threading.Thread(target=lambda k, rows: got.__setitem__(k, stream(rows)), args=(k, rows))
               for k, rows in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for k, rows in (("a", a), ("b", b)):
        out, _ = got[k]
        assert _key(out) == _key(per_task(rows)[0])
        assert [(r.id, r.sample) for r in out] == [(r.id, s) for r in rows for s in r.samples]
    assert len({r.generation for r in got["b"][0] if r.id == "b0"}) > 1  # the samples differ


def test_a_failing_session_step_isolates_the_failing_prompt(tiny, monkeypatch):
    """A session step that raises: the session is dropped, the prompts it held are rerun alone, and only
    the prompt that fails on its own becomes an error row; the rest equal the per-task path."""
    _, per_task, stream = _generators(tiny)
    a, b = _tasks(tiny[2])
    bad = stream.gen.prepare([a[2]])[1][0].ids  # the prompt of row a2 breaks any forward it is in
    cls = type(stream.engine.runner)
    real = cls.prefill_rows

    def prefill_rows(self, prompts, **kw):
        if any(list(p) == bad for p in prompts):
            raise RuntimeError("injected")
        return real(self, prompts, **kw)

    monkeypatch.setattr(cls, "prefill_rows", prefill_rows)
    out_a, _ = stream.wait(stream.put(a))
    out_b, _ = stream(b)
    errors = {r.id: r.error for r in out_a + out_b if r.error}
    assert set(errors) == {"a2", "a4"} and "injected" in errors["a2"]
    monkeypatch.undo()
    ref = {r.id: r for r in per_task(a)[0] + per_task(b)[0]}
    assert all(_key([r]) == _key([ref[r.id]]) for r in out_a + out_b if r.id not in errors)


def test_a_task_that_cannot_be_prepared_fails_alone(tiny):
    """A task whose rows break encoding (a row without a prompt) raises in its own caller only; a task
    queued with it still gets its rows."""
    _, per_task, stream = _generators(tiny)
    bad, good = stream.put([None]), stream.put([InputRow("g", SHORT[0])])
    with pytest.raises(AttributeError):
        stream.wait(bad)
    assert _key(stream.wait(good)[0]) == _key(per_task([InputRow("g", SHORT[0])])[0])

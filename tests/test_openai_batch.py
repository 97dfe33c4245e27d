"""OpenAI batch files in and out (pipeline/io/openai_batch.py, openai_results.py, ``logitspec run-batch``):
request lines as rows, broken lines as error rows naming the line and field, the results file in the
OpenAI batch output shape (parsed with the ``openai`` package's types), resume, and the same generations
as the job's own columns."""
import dataclasses
import json
import pathlib

import pytest
from test_pipeline import _cfg, _write_jsonl, ray_session, tiny  # noqa: F401 - fixtures shared

from pipeline.errors import ConfigError
from pipeline.io.json_rows import PROBLEM
from pipeline.io.openai_batch import as_openai_job, is_openai_batch, parse_line

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _request(cid, url, **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "tiny", **body}}


REQUESTS = [
    _request("chat-1", CHAT, messages=[{"role": "user", "content": "Tell me about the quick brown fox"}],
             max_tokens=6, n=2, temperature=0.8, seed=11),
    _request("cmpl-1", COMPLETIONS, prompt="Once upon a time there was", max_tokens=8, stop=" the"),
    _request("chat-2", CHAT, max_completion_tokens=5, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Lorem ipsum"}]}]),
]


def _write_batch(path: pathlib.Path, broken: bool = True, stop: str = " the") -> pathlib.Path:
    lines = [json.dumps(r) for r in REQUESTS]
    lines[1] = lines[1].replace('"stop": " the"', f'"stop": {json.dumps(stop)}')
    if broken:
        lines.insert(2, '{"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {')
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_request_line_becomes_a_row_of_the_jobs_columns():
    row = parse_line(4, json.dumps(REQUESTS[0]))
    assert PROBLEM not in row and row["custom_id"] == "chat-1" and row["line"] == 4
    assert row["messages"] == REQUESTS[0]["body"]["messages"] and row.get("prompt") is None
    assert (row["max_new_tokens"], row["n"], row["temperature"], row["seed"]) == (6, 2, 0.8, 11)
    row = parse_line(5, json.dumps(REQUESTS[1]))
    assert row["prompt"] == "Once upon a time there was" and row["stop"] == [" the"]
    assert row["url"] == COMPLETIONS
    row = parse_line(6, json.dumps(REQUESTS[2]))
    assert row["messages"][1] == {"role": "user", "content": "Lorem ipsum"} and row["max_new_tokens"] == 5


@pytest.mark.parametrize("line, says", [
    ("{not json", "line 7: not valid JSON"),
    (json.dumps({"method": "POST", "url": CHAT, "body": {}}), "line 7: custom_id must be"),
    (json.dumps(_request("x", "/v1/embeddings", input="a")), "line 7: url must be"),
    (json.dumps(_request("x", CHAT, messages=[{"role": "user", "content": "a"}], logprobs=True)),
     "body.logprobs = true is not supported"),
    (json.dumps(_request("x", CHAT, messages=[{"role": "user", "content": "a"}], tools=[{"x": 1}])),
     "body.tools"),
    (json.dumps(_request("x", COMPLETIONS, prompt="a", temperature="hot")), "temperature must be a number"),
    (json.dumps(_request("x", COMPLETIONS, prompt="a", max_tokens=0)), "max_new_tokens must be >= 1"),
    (json.dumps(_request("x", COMPLETIONS, prompt="a", seed=2 ** 64)), "seed must be an integer (64-bit)"),
    (json.dumps(_request("x", COMPLETIONS, prompt="a", n=5000)), "body.n must be an integer from 1 to 1024"),
    (json.dumps(_request("x", COMPLETIONS, messages=[{"role": "user", "content": "a"}])), "messages is for"),
    (json.dumps(_request("x", CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
     "body.messages[0].content: only text parts"),
    (json.dumps(_request("x", COMPLETIONS, prompt="a", max_tokens=3, max_completion_tokens=4)), "differ"),
])
def test_a_line_that_is_not_a_valid_request_is_a_problem_naming_the_line_and_field(line, says):
    row = parse_line(7, line)
    assert says in row[PROBLEM] and row[PROBLEM].startswith("line 7: ")
    assert row.get("prompt") is None and row.get("messages") is None and row["custom_id"]


def test_an_openai_file_is_recognised_and_another_input_cannot_ask_for_openai_results(tmp_path, tiny):  # noqa: F811
    batch = _write_batch(tmp_path / "requests.jsonl")
    table = _write_jsonl(tmp_path / "rows.jsonl", [{"id": 1, "prompt": "hi"}])
    assert is_openai_batch(batch) and not is_openai_batch(table)
    cfg = as_openai_job(_cfg(tiny, batch, tmp_path / "out"))
    assert (cfg.input_format, cfg.id_column, cfg.messages_column) == ("openai", "custom_id", "messages")
    assert "n" in cfg.request_columns and "stop" in cfg.request_columns
    assert as_openai_job(_cfg(tiny, table, tmp_path / "out")).input_format == "auto"
    with pytest.raises(ConfigError, match="needs an OpenAI batch input"):
        as_openai_job(_cfg(tiny, table, tmp_path / "out", output_format="openai"))


def test_a_dry_run_of_an_openai_file_counts_its_samples_and_names_the_broken_line(tmp_path, tiny, capsys):  # noqa: F811
    """The plan reads the file as requests: each request's own n, the chat requests' messages, the broken
    line rejected before generation (no Ray, nothing written)."""
    from pipeline.job.cli import main

    batch = _write_batch(tmp_path / "requests.jsonl")
    assert main(["--input", str(batch), "--output", str(tmp_path / "out"), "--model", tiny, "--dry-run",
                 "--chat-template", TEMPLATE]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["rows"], plan["to_generate"], plan["rejected_before_generation"]) == (4, 4, 1)
    assert [r["id"] for r in plan["rejected_rows"]["first"]] == ["line 3"]
    assert not (tmp_path / "out").exists()


def test_the_results_file_holds_each_request_whose_samples_are_all_done_in_input_order(tmp_path):
    """From the output's rows: requests in input order with their samples in order; a request still
    missing a sample is left out; samples beyond a request's n (an earlier run's larger n) and
    duplicated keys are ignored; a failed sample makes the request an error line."""
    import numpy as np
    import pyarrow as pa

    from pipeline.io.openai_results import COLUMNS, write_results
    from pipeline.job.pending import InputIndex

    def row(i, s, error=None):
        return {"id": i, "sample": s, "generation": None if error else f"{i}/{s}", "finish_reason": "length",
                "n_prompt_tokens": 5, "n_new_tokens": 2, "steps": 2, "mean_accepted": 1.0,
                "accepted_lengths": [1, 1], "method": "ar", "model": "m", "error": error, "url": COMPLETIONS,
                "line": {"a": 1, "b": 2, "c": 3, "d": 4}[i]}
    out = [row("c", 0), row("a", 1), row("a", 0), row("a", 2), row("b", 0), row("d", 0, "boom"), row("a", 0)]

    class Store:
        def read_existing(self, columns):
            assert tuple(columns) == COLUMNS
            return pa.Table.from_pylist(out)
    ids = pa.array(["a", "b", "c", "d"])
    index = InputIndex(None, ids, pa.string(), False, samples=np.array([2, 2, 1, 1]))
    path = tmp_path / "r.jsonl"
    assert write_results(Store(), index, 1, path, slice_rows=2) == 3
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["a", "c", "d"]
    assert [c["text"] for c in lines[0]["response"]["body"]["choices"]] == ["a/0", "a/1"]
    assert lines[2]["error"] == {"code": "generation_failed", "message": "boom", "line": 4}


def _results(path: pathlib.Path) -> dict:
    from openai.types import BatchError, Completion
    from openai.types.chat import ChatCompletion

    out = {}
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        assert set(doc) == {"id", "custom_id", "response", "error"}
        if doc["error"] is not None:
            error = BatchError.model_validate(doc["error"])
            assert doc["response"] is None and error.code and error.message and error.line
        else:
            assert doc["response"]["status_code"] == 200
            body = doc["response"]["body"]
            kind = ChatCompletion if body["object"] == "chat.completion" else Completion
            kind.model_validate(body)
        out[doc["custom_id"]] = doc
    return out


@pytest.mark.slow
@pytest.mark.ray
def test_an_openai_batch_file_runs_through_the_job_and_run_batch_and_resumes(tmp_path, tiny, ray_session):  # noqa: F811
    """Chat and completion requests, n = 2, a stop string and a broken line, through the job
    (``--output-format openai``) and ``logitspec run-batch``: the results parse with the openai
    package's types, custom_ids round-trip in input order, the broken line is an error line naming its
    line, the completion ends before its stop string, a rerun resumes (nothing generated again), and
    every other generation equals what the job gives the same requests written in its own columns."""
    from logitspec.cli import main as cli_main
    from pipeline.io.output import read_generations
    from pipeline.job.run import run_job

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    # the requests in the job's own columns first: the completion's text without a stop gives the
    # stop string the batch file asks for (a letter it generates after its first character)
    own = _write_jsonl(tmp_path / "own.jsonl", [
        {"id": "chat-1", "prompt": None, "messages": REQUESTS[0]["body"]["messages"], "max_new_tokens": 6,
         "n": 2, "temperature": 0.8, "seed": 11},
        {"id": "cmpl-1", "prompt": "Once upon a time there was", "messages": None, "max_new_tokens": 8,
         "temperature": 1.0},  # a request without a temperature samples at the API's default
        {"id": "chat-2", "prompt": None, "messages": [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Lorem ipsum"}],
         "max_new_tokens": 5, "temperature": 1.0}])
    mine = _with_template(_cfg(tiny, own, tmp_path / "own", messages_column="messages", batch_rows=2,
                               request_columns=("max_new_tokens", "n", "temperature", "seed")))
    assert run_job(mine)["complete"]
    ours = {(r["id"], r["sample"]): r["generation"] for r in read_generations(tmp_path / "own").to_pylist()}
    free = ours.pop(("cmpl-1", 0))
    stop = next(c for c in free[1:] if c.isascii() and c.isalpha() and free.index(c) > 0)

    batch = _write_batch(tmp_path / "requests.jsonl", stop=stop)
    out = tmp_path / "out"
    cfg = _with_template(_cfg(tiny, batch, out, output_format="openai", batch_rows=2))
    summary = run_job(cfg)
    assert summary["complete"] and summary["rows"]["total"] == 5  # 2 + 1 + 1 + the broken line's 1
    assert summary["openai_results"]["lines"] == 4
    got = _results(out / "_results.jsonl")
    assert list(got) == ["chat-1", "cmpl-1", "line 3", "chat-2"]
    broken = got["line 3"]["error"]
    assert broken["line"] == 3 and "line 3: not valid JSON" in broken["message"]
    chat = got["chat-1"]["response"]["body"]
    assert [c["index"] for c in chat["choices"]] == [0, 1] and chat["usage"]["completion_tokens"] <= 12
    assert chat["logitspec"]["steps"] >= 1 and len(chat["logitspec"]["accepted_lengths"]) == 2
    cmpl = got["cmpl-1"]["response"]["body"]["choices"][0]
    assert cmpl["text"] == free[:free.index(stop)] and cmpl["finish_reason"] == "stop"
    theirs = {(k, c["index"]): c.get("text", (c.get("message") or {}).get("content"))
              for k, v in got.items() if v["error"] is None for c in v["response"]["body"]["choices"]}
    theirs.pop(("cmpl-1", 0))
    assert theirs == ours and len(ours) == 3

    again = run_job(cfg)  # resume: everything is done, the file written again from the dataset
    assert again["rows"]["done_now"] == 0 and again["rows"]["skipped_already_done"] == 5
    assert _choices(_results(out / "_results.jsonl")) == _choices(got)

    results = tmp_path / "alias.jsonl"
    rc = cli_main(["run-batch", "-i", str(batch), "-o", str(results), "--model", tiny, "--budget", "fixed",
                   "--max-batch-size", "2", "--max-new-tokens", "12", "--chat-template", str(template),
                   "--threads-per-actor", "1", "--no-warmup", "-q"])
    assert rc == 0 and (tmp_path / "alias.jsonl.d").is_dir()
    alias = _results(results)
    assert list(alias) == list(got) and _choices(alias) == _choices(got)


def _with_template(cfg):
    return dataclasses.replace(cfg, gen=dataclasses.replace(cfg.gen, chat_template=TEMPLATE))


def _choices(results: dict) -> dict:
    """custom_id -> its choices, or its error."""
    return {k: v["error"] or v["response"]["body"]["choices"] for k, v in results.items()}

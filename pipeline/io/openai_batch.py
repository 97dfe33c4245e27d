"""OpenAI Batch API request files as the job's input.

Each line of such a JSONL file is one request, ``{"custom_id", "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body": {...}}``, as the OpenAI Batch API and
``vllm run-batch`` take it. A line becomes one input row of these columns (:data:`TYPES`):
``custom_id`` (the row's id), ``url``, ``model``, ``line`` (its line number), ``messages`` (chat) or
``prompt`` (completions), and the body's settings under the job's request-column names
(``max_tokens`` / ``max_completion_tokens`` -> ``max_new_tokens``; ``n``, ``stop``, ``seed``,
``temperature``, ``top_p``, ``top_k``; a request without a temperature samples at 1.0, the API's
default; one without a token limit gets the job's ``--max-new-tokens``). A line that is not a valid
request still becomes a row: its
problem (naming the line and the field) makes it an error row. Body fields that would change the
output and are not supported here (``logprobs``, ``tools``, penalties, ...) are problems too, unless
they hold their neutral value.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterator

import pyarrow as pa

from logitspec.engine.request import Request

from ..errors import ConfigError
from .json_rows import PROBLEM
from .row_checks import REQUEST_KINDS, fits_request_column

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
TYPES = {"custom_id": pa.string(), "url": pa.string(), "model": pa.string(), "line": pa.int64(),
         "prompt": pa.string(), "messages": pa.list_(MESSAGE), "max_new_tokens": pa.int64(),
         "temperature": pa.float64(), "top_p": pa.float64(), "top_k": pa.int64(), "seed": pa.int64(),
         "n": pa.int64(), "stop": pa.list_(pa.string())}
REQUEST_COLUMNS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop")
KEPT_COLUMNS = "url,line"  # the input columns the output rows carry: what the results file needs
_SETTINGS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature":
             "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed", "n": "n", "stop": "stop"}
OPENAI_TEMPERATURE = 1.0  # the API's default where a request gives none (the job's --temperature is not used)
# body fields accepted at these values only (what they do is not done here)
_NEUTRAL = {"stream": (False,), "logprobs": (False, None), "top_logprobs": (0, None), "echo": (False,),
            "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "best_of": (1,),
            "logit_bias": ({},), "tools": ([],), "response_format": ({"type": "text"},),
            "stream_options": (None,), "parallel_tool_calls": (True, False, None)}
_IGNORED = ("model", "user", "metadata", "store", "service_tier")  # accepted, no effect on the tokens


def is_openai_batch(path: pathlib.Path) -> bool:
    """Whether ``path`` is a JSONL file whose first request line has a ``custom_id``, a ``url`` and a
    ``body``."""
    if not path.is_file() or path.suffix.lower() not in (".jsonl", ".ndjson", ".json"):
        return False
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and {"custom_id", "url", "body"} <= set(first)
    return False


def has_chat_requests(path: pathlib.Path) -> bool:
    """Whether any line of the file asks for a chat completion (one pass)."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        return any(CHAT in line and _url(line) == CHAT for line in fh)


def _url(line: str):
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return obj.get("url") if isinstance(obj, dict) else None


def read_requests(path: pathlib.Path, columns: list[str], rows: int) -> Iterator[pa.Table]:
    """Tables of ``columns`` (of :data:`TYPES`) and ``__problem__``, ``rows`` lines each, in file order."""
    chunk: list[dict] = []

    def table() -> pa.Table:
        arrays = {c: pa.array([r.get(c) for r in chunk], TYPES[c]) for c in columns}
        return pa.table({**arrays, PROBLEM: pa.array([r.get(PROBLEM) for r in chunk], pa.string())})

    try:
        with open(path, encoding="utf-8") as fh:
            for n, text in enumerate(fh, 1):
                if text.strip():
                    chunk.append(parse_line(n, text))
                    if len(chunk) == rows:
                        yield table()
                        chunk = []
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 ({e.reason}); save the file as UTF-8") from None
    if chunk:
        yield table()


def parse_line(n: int, text: str) -> dict:
    """One request line as a row of :data:`TYPES`' columns; a problem in ``__problem__``."""
    row: dict = {"line": n, "custom_id": f"line {n}"}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return {**row, PROBLEM: f"line {n}: not valid JSON ({e.msg})"}
    if not isinstance(obj, dict):
        return {**row, PROBLEM: f"line {n}: a request is a JSON object, got {type(obj).__name__}"}
    custom_id = obj.get("custom_id")
    if isinstance(custom_id, str) and custom_id:
        row["custom_id"] = custom_id
    problem = _request_problem(obj, row)
    if problem:
        for c in ("prompt", "messages", *REQUEST_COLUMNS):
            row.pop(c, None)
        row[PROBLEM] = f"line {n}: {problem}"
    return row


def _request_problem(obj: dict, row: dict) -> str | None:
    """Fill ``row`` from the request ``obj``; the first problem found, or None."""
    if not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        return "custom_id must be a non-empty string"
    if obj.get("method", "POST") != "POST":
        return f"method must be POST, got {obj.get('method')!r}"
    url, body = obj.get("url"), obj.get("body")
    row["url"] = url if isinstance(url, str) else None
    if url not in (CHAT, COMPLETIONS):
        return f"url must be {CHAT} or {COMPLETIONS}, got {url!r}"
    if not isinstance(body, dict):
        return "body must be a JSON object"
    given: dict = {}
    for key, value in body.items():
        if key in _SETTINGS:
            name = _SETTINGS[key]
            if name in given and given[name] != value:
                return f"body.max_tokens and body.max_completion_tokens differ ({given[name]}, {value})"
            if value is not None:
                given[name] = value
        elif key in _NEUTRAL:
            if value not in _NEUTRAL[key]:
                return f"body.{key} = {json.dumps(value)} is not supported here"
        elif key in _IGNORED:
            if key == "model" and isinstance(value, str):
                row["model"] = value
        elif key not in ("messages", "prompt"):
            return f"body.{key} is not supported here"
    if given.get("top_k") == -1:  # vLLM's and the OpenAI servers' "off"
        del given["top_k"]
    given.setdefault("temperature", OPENAI_TEMPERATURE)
    problem = _settings_problem(given)
    if problem:
        return problem
    row.update(given, stop=[given["stop"]] if isinstance(given.get("stop"), str) else given.get("stop"))
    return _chat_problem(body, row) if url == CHAT else _prompt_problem(body, row)


def _settings_problem(given: dict) -> str | None:
    back = {v: k for k, v in _SETTINGS.items() if k != "max_completion_tokens"}
    for name, value in given.items():
        if not fits_request_column(name, value):
            return f"body.{back[name]} must be {REQUEST_KINDS[name]}, got {json.dumps(value)}"
    try:
        Request.make(**given)
    except ValueError as e:
        return f"body: {e}"
    return None


def _chat_problem(body: dict, row: dict) -> str | None:
    messages = body.get("messages")
    if "prompt" in body:
        return "body.prompt is for /v1/completions; a chat request gives body.messages"
    if not isinstance(messages, list) or not messages:
        return "body.messages must be a non-empty list"
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"body.messages[{i}] must be an object with a role"
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                return f"body.messages[{i}].content: only text parts are supported here"
            content = "\n".join(p["text"] for p in content)  # as vLLM joins text parts
        if not isinstance(content, str):
            return f"body.messages[{i}].content must be a string"
        out.append({"role": m["role"], "content": content})
    row["messages"] = out
    return None


def _prompt_problem(body: dict, row: dict) -> str | None:
    prompt = body.get("prompt")
    if "messages" in body:
        return "body.messages is for /v1/chat/completions; a completion request gives body.prompt"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return "body.prompt must be a string (one prompt per request here)"
    row["prompt"] = prompt
    return None


def as_openai_job(cfg):
    """``cfg`` (:class:`~pipeline.job.config.JobConfig`) reading its input as an OpenAI batch file where
    it is one (``input_format`` "openai", or "auto" and the file looks like one): the columns above in
    the job's roles. ConfigError where ``--output-format openai`` is asked of another input."""
    path = pathlib.Path(cfg.input).expanduser()
    openai = cfg.input_format == "openai" or (cfg.input_format == "auto" and is_openai_batch(path))
    if not openai:
        if cfg.output_format == "openai":
            raise ConfigError("--output-format openai writes OpenAI batch results: it needs an OpenAI batch "
                              "input file (JSONL of {custom_id, method, url, body})")
        return cfg
    if not path.is_file():
        raise ConfigError(f"--input-format openai reads one JSONL file; {cfg.input!r} is not a file")
    return dataclasses.replace(
        cfg, input_format="openai", id_column="custom_id", prompt_column="prompt",
        messages_column="messages" if has_chat_requests(path) else None, request_columns=REQUEST_COLUMNS,
        keep_columns=KEPT_COLUMNS)

"""Checks of single input rows (no tokenizer needed): a row that fails one becomes an error row."""
from __future__ import annotations

from typing import Any

# decoding settings a row may carry in an input column of the same name (--request-columns); rows with
# different values share a batch, each decoding as it would alone (n: the row's samples, in place of
# --num-samples; stop: a string or a list of strings)
REQUEST_COLUMNS = ("max_new_tokens", "seed", "temperature", "top_p", "top_k", "n", "stop")
INTEGER_REQUEST_COLUMNS = ("max_new_tokens", "seed", "top_k", "n")
MAX_ROW_SAMPLES = 1024  # the most samples a row may ask for in its n column
REQUEST_KINDS = {**dict.fromkeys(REQUEST_COLUMNS, "a number"),
                 **dict.fromkeys(INTEGER_REQUEST_COLUMNS, "an integer (64-bit)"),
                 "n": f"an integer from 1 to {MAX_ROW_SAMPLES}", "stop": "a string or a list of strings"}


def row_samples_ok(n) -> bool:
    """Whether ``n`` is a usable sample count for one row."""
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_ROW_SAMPLES


def fits_request_column(column: str, value) -> bool:
    """Whether ``value`` has the type request column ``column`` takes (:data:`REQUEST_KINDS`)."""
    if column == "n":
        return row_samples_ok(value)
    if column == "stop":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -2 ** 63 <= value < 2 ** 63  # what an int64 column holds
    return column not in INTEGER_REQUEST_COLUMNS and isinstance(value, float)


def row_problem(prompt: Any, messages: Any = None, use_messages: bool = False) -> str | None:
    """Why this row cannot be generated (checked in the driver, no tokenizer needed), or None."""
    if use_messages and messages is not None:
        if not isinstance(messages, list) or not messages:
            return "messages must be a non-empty list of {role, content} objects"
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                return f"malformed message {m!r}: need {{'role': str, 'content': str}}"
        return None
    if prompt is None:
        return "prompt is null" if not use_messages else "prompt and messages are both null"
    if isinstance(prompt, str):
        return "empty prompt" if not prompt.strip() else None
    if isinstance(prompt, list):
        if not prompt:
            return "empty prompt"
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None
        return "a list prompt must hold token ids (integers)"
    return f"prompt has type {type(prompt).__name__}; expected a string (or a list of token ids)"


def row_prompt(prompt: Any, messages: Any, use_messages: bool) -> Any:
    """What the engine encodes for a row that passed :func:`row_problem`."""
    return messages if use_messages and messages is not None else prompt

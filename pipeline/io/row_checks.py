"""Checks of single input rows (no tokenizer needed): a row that fails one becomes an error row."""
from __future__ import annotations

from typing import Any


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

"""Build ``prompts.jsonl``: the demo's rows, the kinds of work the job is for, from local material.

Each row puts a document in the prompt and asks for something the answer partly copies, as the
job's users do: documents to summarize, questions over a passage, code to edit, a multi-turn chat
over a document. The documents are sections of Python's language reference (``pydoc_data.topics``,
shipped with Python, PSF licence) and functions of Python's standard library (their source); a
prompt is plain text ending where the answer starts (the embedded Gemma 3's tokenizer has no chat
template). Rows are ``{"id", "task", "source", "prompt"}``. Rerun after editing the lists below
(the file is committed, so a different Python only matters when it is rebuilt):

    python data/demo/make_prompts.py
"""
from __future__ import annotations

import inspect
import json
import pathlib
import shlex
import string
import textwrap
from pydoc_data.topics import topics

HERE = pathlib.Path(__file__).resolve().parent
MAX_CHARS = 2400  # a document's characters at most (about 600 tokens): the demo stays a few minutes on a CPU

SUMMARIES = ["with", "for", "assert", "raise"]
QUESTIONS = {  # topic: question the passage answers
    "global": "Which names must not be used in the same code block before a \"global\" statement?",
    "del": "What happens when a name that is unbound is deleted?",
    "return": "What does \"return\" do inside a generator function?",
    "while": "When is the suite of the \"else\" clause of a \"while\" loop executed?",
}
EDITS = [  # (function, instruction)
    (textwrap.indent, "Add type hints to the function's parameters and return value."),
    (textwrap.dedent, "Rename the local variable \"margin\" to \"common_prefix\" everywhere."),
    (shlex.quote, "Add a doctest example to the docstring."),
    (string.capwords, "Rewrite the function without the conditional expression, using an if statement."),
]
CHATS = {  # topic: (first question, first answer, second question)
    "try": ("What is this document about?", "It explains Python's \"try\" statement and its clauses.",
            "What happens to an exception that is not handled by any \"except\" clause?"),
    "yield": ("What is this document about?", "It explains Python's \"yield\" expression and statement.",
              "Quote the sentence that says what a yield statement is equivalent to."),
}


def document(topic: str) -> str:
    """The language reference's section on ``topic``, cut at a paragraph near ``MAX_CHARS``."""
    text = topics[topic].strip()
    if len(text) <= MAX_CHARS:
        return text
    cut = text.rfind("\n\n", 0, MAX_CHARS)
    return text[:cut if cut > 0 else MAX_CHARS]


def rows() -> list[dict]:
    out = []
    for topic in SUMMARIES:
        out.append({"id": f"summary-{topic}", "task": "summary", "source": f"pydoc_data.topics[{topic!r}]",
                    "prompt": f"Document:\n{document(topic)}\n\nSummarize the document above in three "
                              f"sentences.\n\nSummary:"})
    for topic, question in QUESTIONS.items():
        out.append({"id": f"question-{topic}", "task": "question", "source": f"pydoc_data.topics[{topic!r}]",
                    "prompt": f"Passage:\n{document(topic)}\n\nAnswer the question from the passage, quoting "
                              f"it where you can.\nQuestion: {question}\nAnswer:"})
    for fn, instruction in EDITS:
        code = inspect.getsource(fn)
        out.append({"id": f"edit-{fn.__module__}.{fn.__name__}", "task": "code_edit",
                    "source": f"{fn.__module__}.{fn.__name__}",
                    "prompt": f"```python\n{code}```\n\n{instruction} Reply with the whole function.\n\n"
                              f"```python\n"})
    for topic, (q1, a1, q2) in CHATS.items():
        out.append({"id": f"chat-{topic}", "task": "chat", "source": f"pydoc_data.topics[{topic!r}]",
                    "prompt": f"A conversation about the document below.\n\nDocument:\n{document(topic)}\n\n"
                              f"User: {q1}\nAssistant: {a1}\nUser: {q2}\nAssistant:"})
    return out


def main() -> None:
    path = HERE / "prompts.jsonl"
    built = rows()
    path.write_text("".join(json.dumps(r) + "\n" for r in built))
    print(f"wrote {path} ({len(built)} rows)")


if __name__ == "__main__":
    main()

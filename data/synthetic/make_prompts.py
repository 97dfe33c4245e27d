"""Build ``prompts.jsonl``: instruction prompts over seed passages, the shape of a synthetic-data job.

Each seed passage (a document of ``data/sample_corpus``) is combined with each instruction template;
a row is ``{"id", "template", "source", "prompt", "messages"}``: ``prompt`` is plain text ending where the
answer starts (for any model, e.g. the embedded Gemma 3, whose tokenizer has no chat template),
``messages`` the same instruction as a one-turn chat (for chat models: ``--messages-column messages``).
Rerun after editing the templates:

    python data/synthetic/make_prompts.py
"""
from __future__ import annotations

import json
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
CORPUS = HERE.parent / "sample_corpus"
SKIP = {"lorem-ipsum"}  # not a text anyone would generate questions about

TEMPLATES = {  # name: (instruction, where a plain-text prompt's answer starts)
    "questions": ("Write three questions that a reader can answer from the passage below, one per line.\n\n"
                  "Passage:\n{passage}", "Questions:\n1."),
    "summary": ("Summarize the passage below in two sentences.\n\nPassage:\n{passage}", "Summary:"),
    "qa": ("Write one question about the passage below and answer it, in the form\nQ: ...\nA: ...\n\n"
           "Passage:\n{passage}", "Q:"),
}


def rows() -> list[dict]:
    out = []
    for doc in sorted(CORPUS.rglob("*.txt")):
        if doc.stem in SKIP:
            continue
        passage = doc.read_text().strip()
        for name, (template, answer_start) in TEMPLATES.items():
            instruction = template.format(passage=passage)
            out.append({"id": f"{doc.stem}-{name}", "template": name, "source": str(doc.relative_to(CORPUS)),
                        "prompt": f"{instruction}\n\n{answer_start}",
                        "messages": [{"role": "user", "content": instruction}]})
    return out


def main() -> None:
    path = HERE / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"wrote {path} ({len(rows())} rows)")


if __name__ == "__main__":
    main()

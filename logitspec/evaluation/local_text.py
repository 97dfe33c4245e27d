"""Local source material for generated evaluation data: Python standard-library modules (code and the
prose of their docstrings) and the plain-text corpus in ``data/sample_corpus``.

Everything is read from this machine; modules are parsed lazily, in a caller-chosen order, because
parsing the whole standard library takes seconds.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import sysconfig
from dataclasses import dataclass
from typing import Iterator, Sequence

__all__ = [
    "Passage",
    "stdlib_root",
    "stdlib_modules",
    "module_name",
    "module_docstrings",
    "prose_paragraphs",
    "module_passage",
    "corpus_passages",
    "default_corpus_dir",
    "iter_module_passages",
    "sentences",
]

# folders of the standard library that hold tests, third-party packages or caches, not library code
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")
_MIN_SUMMARY_CHARS = 20
_MAX_SUMMARY_CHARS = 300


@dataclass(frozen=True)
class Passage:
    """A piece of prose with a title, a source, and (for modules) a one-line summary not in ``text``."""

    title: str
    text: str
    source: str
    summary: str | None = None


def stdlib_root() -> pathlib.Path:
    """This interpreter's standard-library directory (``sysconfig.get_paths()["stdlib"]``)."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_modules(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Every ``.py`` file of the standard library outside test and package folders, sorted by path."""
    root = stdlib_root() if root is None else root
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        found.extend(pathlib.Path(folder) / f for f in sorted(files) if f.endswith(".py"))
    return sorted(found)


def module_name(path: pathlib.Path, root: pathlib.Path | None = None) -> str:
    """Dotted module name of a standard-library file (``email/utils.py`` -> ``email.utils``)."""
    rel = path.relative_to(stdlib_root() if root is None else root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def module_docstrings(path: pathlib.Path) -> tuple[str | None, list[str]]:
    """``(module docstring, its classes' and functions' docstrings in source order)``, cleaned.

    An unreadable or unparsable file gives ``(None, [])``.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None, []
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                found.append((node.lineno, doc))
    return ast.get_docstring(tree, clean=True), [doc for _, doc in sorted(found, key=lambda item: item[0])]


def _is_prose(paragraph: str) -> bool:
    lines = paragraph.split("\n")
    if any(line[:1].isspace() or line.lstrip().startswith((">>>", "...", "-", "*", ":")) for line in lines):
        return False  # indented code, doctests, option and bullet lists, field lists
    text = " ".join(lines)
    if len(text) < 60 or not text[0].isupper() or text[-1] not in ".!?":
        return False
    plain = sum(ch.isalpha() or ch in " ,.;'()-" for ch in text)
    return plain / len(text) >= 0.9


def prose_paragraphs(doc: str) -> list[str]:
    """The paragraphs of a docstring that read as prose, each joined onto one line."""
    blocks = re.split(r"\n\s*\n", doc.strip())
    return [" ".join(b.split()) for b in blocks if _is_prose(b)]


def module_passage(path: pathlib.Path, root: pathlib.Path | None = None) -> Passage | None:
    """A module as a passage: ``summary`` is its docstring's first paragraph (one sentence or a few),
    ``text`` the prose of the rest of its docstrings; None when either is missing."""
    module_doc, docs = module_docstrings(path)
    name = module_name(path, root)
    if not module_doc or not name:
        return None
    head, _, body = module_doc.strip().partition("\n\n")
    summary = " ".join(head.split())
    if not _MIN_SUMMARY_CHARS <= len(summary) <= _MAX_SUMMARY_CHARS or summary[-1] not in ".!?":
        return None
    paragraphs = prose_paragraphs(body)
    for doc in docs:
        paragraphs.extend(prose_paragraphs(doc))
    if not paragraphs:
        return None
    return Passage(title=name, text=" ".join(paragraphs), source=f"stdlib:{name}", summary=summary)


def iter_module_passages(
    paths: Sequence[pathlib.Path], root: pathlib.Path | None = None
) -> Iterator[Passage]:
    """:func:`module_passage` of each path in order, skipping modules without one."""
    for path in paths:
        passage = module_passage(path, root)
        if passage is not None:
            yield passage


def default_corpus_dir() -> pathlib.Path:
    """``data/sample_corpus`` of this source checkout (it may be absent in an installed package)."""
    return pathlib.Path(__file__).resolve().parents[2] / "data" / "sample_corpus"


def corpus_passages(corpus_dir: pathlib.Path | None) -> list[Passage]:
    """Each ``*.txt`` file under ``corpus_dir`` as one passage (title from its file name), sorted by path;
    empty when the directory does not exist."""
    if corpus_dir is None or not corpus_dir.is_dir():
        return []
    passages = []
    for f in sorted(corpus_dir.rglob("*.txt")):
        text = " ".join(f.read_text(encoding="utf-8").split())
        if text:
            title = f.stem.replace("-", " ").title()
            passages.append(
                Passage(title=title, text=text, source=f"sample_corpus:{f.relative_to(corpus_dir)}")
            )
    return passages


def sentences(text: str) -> list[str]:
    """``text`` split after ``.``, ``!`` or ``?`` followed by whitespace and a capital (or quote)."""
    return [s for s in _SENTENCE_END.split(text) if s]

"""Generate a small LongBench-format set with ground truth from local material only.

    python -m logitspec.evaluation.make_data --out DIR --tokens 4000 --per-dataset 3 --tokenizer default

Writes ``DIR/<dataset>.jsonl`` for ``lcc``, ``passage_retrieval_en``, ``passage_count``, ``hotpotqa``
and ``kv_retrieval`` (see docs/evaluation.md), and ``DIR/meta.json`` with the settings. Rows are
sized so that the filled prompt is about ``--tokens`` tokens, counted with the tokenizer of
``--tokenizer`` (a model spec; ``default`` is the embedded Gemma 3 270M, loaded without its model) or
as characters / 4 with ``--tokenizer none``. The same seed, Python standard library and corpus give
the same files.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
from typing import Callable, Sequence

from .local_text import default_corpus_dir
from .longbench import Example, write_dataset
from .synth import Sources, row_rng
from .synth_code import build_lcc
from .synth_facts import build_hotpotqa, build_kv_retrieval
from .synth_passages import build_passage_count, build_passage_retrieval
from .token_count import TokenCounter, make_counter

__all__ = ["BUILDERS", "generate", "main"]

Builder = Callable[..., list[Example]]
BUILDERS: dict[str, Builder] = {
    "lcc": build_lcc,
    "passage_retrieval_en": build_passage_retrieval,
    "passage_count": build_passage_count,
    "hotpotqa": build_hotpotqa,
    "kv_retrieval": build_kv_retrieval,
}


def generate(
    out: pathlib.Path,
    *,
    tokens: int,
    per_dataset: int,
    counter: TokenCounter,
    seed: int = 0,
    datasets: Sequence[str] = tuple(BUILDERS),
    sources: Sources | None = None,
) -> dict[str, list[Example]]:
    """Build and write ``per_dataset`` rows of each dataset, plus ``meta.json``; return the rows."""
    unknown = [d for d in datasets if d not in BUILDERS]
    if unknown:
        raise ValueError(f"no local builder for {unknown}; available: {', '.join(BUILDERS)}")
    if tokens < 200 or per_dataset < 1:
        raise ValueError(f"need tokens >= 200 and per_dataset >= 1, got {tokens} and {per_dataset}")
    sources = Sources(seed=seed, corpus_dir=default_corpus_dir()) if sources is None else sources
    rows = {}
    for name in datasets:
        rows[name] = BUILDERS[name](row_rng(seed, name), per_dataset, tokens, counter, sources)
        write_dataset(out, name, rows[name])
    meta = {
        "generator": "python -m logitspec.evaluation.make_data",
        "tokens": tokens,
        "per_dataset": per_dataset,
        "seed": seed,
        "tokens_by": counter.name,
        "python": platform.python_version(),
        "corpus": _shown(sources.corpus_dir),
        "datasets": {name: len(r) for name, r in rows.items()},
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return rows


def _shown(path: pathlib.Path | None) -> str | None:
    """A path as the user would write it: relative to the working directory when under it."""
    if path is None:
        return None
    try:
        return path.resolve().relative_to(pathlib.Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m logitspec.evaluation.make_data", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, type=pathlib.Path, help="output directory")
    p.add_argument("--tokens", type=int, default=4000, help="target prompt length in tokens (default 4000)")
    p.add_argument("--per-dataset", type=int, default=3, help="rows per dataset (default 3)")
    p.add_argument(
        "--tokenizer",
        default="default",
        help="model spec whose tokenizer counts tokens, or 'none' for characters/4",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--datasets", default=",".join(BUILDERS), help=f"comma-separated subset of {','.join(BUILDERS)}"
    )
    p.add_argument("--corpus", type=pathlib.Path, default=default_corpus_dir(), help="text corpus directory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    counter = make_counter(args.tokenizer)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    sources = Sources(seed=args.seed, corpus_dir=args.corpus)
    try:
        rows = generate(
            args.out,
            tokens=args.tokens,
            per_dataset=args.per_dataset,
            counter=counter,
            seed=args.seed,
            datasets=datasets,
            sources=sources,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, examples in rows.items():
        sizes = [e.extra["tokens"] for e in examples]
        print(f"{name}: {len(examples)} rows, prompt tokens {min(sizes)}-{max(sizes)} ({counter.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""REST (He et al. 2023, "REST: Retrieval-Based Speculative Decoding"): drafts retrieved from a
datastore by the longest suffix of the context that occurs in it.

Per step, with the context ending in the root ``x1`` (REST queries ``input_ids + [x1]`` too):

1. Lookup: the longest suffix of the context, of ``max_span`` (16) down to ``min_span`` (2) tokens,
   that occurs in the datastore; its occurrences (the first ``max_matches`` (5000) in suffix-array
   order) each give a continuation of up to ``continuation`` (10) tokens.
2. Trie: every prefix of every continuation is a node, weighted by how many continuations share it;
   the ``num_draft`` (64) heaviest nodes are kept (a parent is never lighter than its child, so the
   kept set is a tree). Ties go to the shallower node, then to the lexicographically first one.

The defaults are REST's (FasterDecoding/REST: ``--max-token-span 16`` and ``token_spans = 16..2``,
``--num-draft 64`` in ``llm_judge/gen_model_answer_rest.py``; ``k = 5000`` matches and ``long = 10``
tokens per continuation in DraftRetriever's ``Reader.search``). REST keeps the top ``choices``
prefixes by count with a heap and trims ties best effort; here the tie rule is exact and the node
count is also capped by the step's budget.

The datastore (:class:`Datastore`) holds the corpus's tokens (documents separated by -1, so no
continuation spans two documents) and a suffix array over them, built with numpy by prefix doubling
(``argsort`` of rank pairs: O(n log n) per round, ``log2(depth)`` rounds; suffixes are ordered by
their first ``depth`` (64) tokens, ties by position: every lookup compares at most ``max_span +
continuation`` = 26 tokens, so the answers are those of a full suffix array). A lookup is a binary
search: O(span log n). Saved as two ``.npy`` files (int32 tokens, int32 or int64 suffixes: 8 bytes
per token) and a ``meta.json``; loaded memory-mapped, so processes on one machine share one copy.
It is also an n-gram source (``lookup``), so PLD and LogitSpec can use it as their reference.

``python -m logitspec.spec_decode.rest build --from-python-stdlib --out DIR`` builds one (see :func:`main`).
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import pathlib
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from logitspec.spec_decode.rest_trie import SEPARATOR, context_matches, gather, select_trie

MAX_SPAN = 16  # REST: the longest context suffix looked up
MIN_SPAN = 2  # REST: the shortest (token_spans = 16, 15, ..., 2)
NUM_DRAFT = 64  # REST: draft nodes (trie nodes) kept
MAX_MATCHES = 5000  # REST (DraftRetriever k): occurrences read per lookup
CONTINUATION = 10  # REST (DraftRetriever long): tokens per continuation
SORT_DEPTH = 64  # suffixes ordered by this many first tokens (>= MAX_SPAN + CONTINUATION)
LOOKUP_SCAN = 64  # occurrences scanned by the n-gram interface (Datastore.lookup), as CorpusIndex


# ------------------------------------------------------------------------------------ suffix array
def suffix_array(tokens: np.ndarray, depth: int | None = None) -> np.ndarray:
    """Start positions of ``tokens``' suffixes in lexicographic order (a suffix that ends compares
    below any longer one; -1 separators below every token), int64 [n].

    Prefix doubling: round r sorts by the first 2**r tokens (one ``argsort`` of rank pairs); with
    ``depth`` it stops once suffixes are ordered by their first ``depth`` tokens (ties: position).
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    _, rank = np.unique(np.asarray(tokens, dtype=np.int64), return_inverse=True)  # dense ranks, order kept
    rank = rank.astype(np.int64).reshape(-1)
    sa = np.argsort(rank, kind="stable")
    k = 1
    while k < n and (depth is None or k < depth):
        if int(rank.max()) == n - 1:  # all distinct: fully sorted
            break
        nxt = np.zeros(n, dtype=np.int64)
        nxt[: n - k] = rank[k:] + 1  # 0: past the end (the smallest)
        key = rank * (n + 1) + nxt  # < n * (n + 1) + n: int64 for n < 3e9
        sa = np.argsort(key, kind="stable")
        ks = key[sa]
        new = np.empty(n, dtype=np.int64)
        new[sa] = np.concatenate(([0], np.cumsum(ks[1:] != ks[:-1])))
        rank = new
        k *= 2
    return sa


# ----------------------------------------------------------------------------------------- datastore
@dataclass
class Datastore:
    """REST's datastore: corpus tokens and their suffix array.

    tokens:   int32 [n]  documents' tokens, each document followed by -1
    suffixes: int  [m]   start positions of the suffixes that start with a token, in suffix order
                         (ordered by their first ``depth`` tokens, ties by position)
    """

    tokens: np.ndarray
    suffixes: np.ndarray
    depth: int = SORT_DEPTH
    meta: dict = field(default_factory=dict)

    @property
    def max_ngram(self) -> int:  # the NgramSource protocol: the longest key a lookup answers exactly
        return self.depth

    @classmethod
    def build(cls, docs: Iterable[Sequence[int]], depth: int = SORT_DEPTH) -> "Datastore":
        """Index token documents (O(n log n log depth) time, 8 bytes per token)."""
        parts = []
        for d in docs:
            parts.append(np.asarray(d, dtype=np.int64).reshape(-1))
            parts.append(np.array([SEPARATOR], dtype=np.int64))
        toks = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if len(toks) and (toks.min() < SEPARATOR or toks.max() >= 2**31):
            raise ValueError("token ids must be in [0, 2**31)")
        sa = suffix_array(toks, depth)
        sa = sa[toks[sa] >= 0]  # a query never starts with a separator
        idx_dtype = np.int32 if len(toks) < 2**31 else np.int64
        return cls(toks.astype(np.int32), sa.astype(idx_dtype), depth,
                   {"documents": len(parts) // 2, "tokens": int(len(toks) - len(parts) // 2)})

    # --- lookups
    def _key(self, span: int):
        toks = self.tokens
        return lambda p: tuple(toks[p : p + span].tolist())

    def match_range(self, query: Sequence[int]) -> tuple[int, int]:
        """``[lo, hi)`` in :attr:`suffixes` of the suffixes starting with ``query`` (binary search)."""
        s = len(query)
        if s > self.depth:
            raise ValueError(f"query of {s} tokens is longer than the datastore's sort depth {self.depth}")
        q = tuple(int(t) for t in query)
        key = self._key(s)
        lo = bisect.bisect_left(self.suffixes, q, key=key)
        hi = bisect.bisect_right(self.suffixes, q, lo=lo, key=key)
        return lo, hi

    def continuations(self, query: Sequence[int], length: int, max_matches: int = MAX_MATCHES) -> np.ndarray:
        """int64 [k, length]: what follows the first ``max_matches`` occurrences of ``query`` (suffix
        order; rows sorted lexicographically), -1 past a document's end; empty rows dropped."""
        lo, hi = self.match_range(query)
        starts = self.suffixes[lo : min(hi, lo + max_matches)].astype(np.int64) + len(query)
        return gather(self.tokens, starts, length)

    def lookup(self, key: Sequence[int], max_tokens: int, max_results: int = 1) -> list[list[int]]:
        """The n-gram source interface (:class:`~logitspec.spec_decode.ngram_index.NgramSource`): up to
        ``max_results`` continuations of ``key`` with distinct first tokens."""
        if max_tokens <= 0 or not len(key) or len(key) > self.depth:
            return []
        conts = self.continuations(key, max_tokens, LOOKUP_SCAN)
        out, firsts = [], set()
        for row in conts:
            if int(row[0]) in firsts:
                continue
            firsts.add(int(row[0]))
            out.append(row[row >= 0].tolist())
            if len(out) >= max_results:
                break
        return out

    def longest_match(self, context: Sequence[int], max_span: int = MAX_SPAN,
                      min_span: int = MIN_SPAN) -> int:
        """The length of the longest suffix of ``context`` (``min_span``..``max_span`` tokens) that
        occurs in the datastore, 0 if none. Binary search over the length: a suffix that occurs
        makes every shorter one occur."""
        lo, hi = min_span, min(max_span, len(context), self.depth)
        best = 0
        while lo <= hi:
            mid = (lo + hi) // 2
            a, b = self.match_range(context[len(context) - mid :])
            if b > a:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    # --- storage
    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes + self.suffixes.nbytes)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flat dict of arrays (for the object store or ``np.savez``); :meth:`from_arrays` inverts it."""
        return {"tokens": self.tokens, "rest_suffixes": self.suffixes,
                "rest_depth": np.array([self.depth], dtype=np.int64)}

    @classmethod
    def from_arrays(cls, arrays, meta: dict | None = None) -> "Datastore":
        return cls(arrays["tokens"], arrays["rest_suffixes"], int(arrays["rest_depth"][0]), dict(meta or {}))

    @staticmethod
    def holds(arrays) -> bool:
        """Whether ``arrays`` (a dict of arrays) are a datastore's (else, e.g., a CorpusIndex's)."""
        return "rest_suffixes" in arrays

    def save(self, out_dir: str | os.PathLike) -> int:
        """Write ``tokens.npy``, ``suffixes.npy`` and ``meta.json`` into ``out_dir``; bytes written."""
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / "tokens.npy", self.tokens)
        np.save(out / "suffixes.npy", self.suffixes)
        meta = {**self.meta, "depth": self.depth, "format": "logitspec-rest-1"}
        (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        return sum(p.stat().st_size for p in (out / "tokens.npy", out / "suffixes.npy", out / "meta.json"))

    @classmethod
    def load(cls, path: str | os.PathLike, mmap: bool = True) -> "Datastore":
        """A datastore written by :meth:`save` (memory-mapped read-only unless ``mmap=False``)."""
        d = pathlib.Path(path)
        if not (d / "meta.json").is_file():
            raise FileNotFoundError(f"{str(d)!r} is not a REST datastore directory (no meta.json; "
                                    f"build one with python -m logitspec.spec_decode.rest build)")
        meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
        mode = "r" if mmap else None
        # plain ndarray views of the read-only mappings: slicing a np.memmap costs twice as much, and
        # a lookup slices a few hundred times
        tokens, suffixes = (np.load(d / name, mmap_mode=mode).view(np.ndarray)
                            for name in ("tokens.npy", "suffixes.npy"))
        return cls(tokens, suffixes, int(meta.get("depth", SORT_DEPTH)), meta)


# ----------------------------------------------------------------------------------------- retrieval
def retrieve(store: "Datastore | None", context: Sequence[int], n_nodes: int, max_span: int = MAX_SPAN,
             min_span: int = MIN_SPAN, continuation: int = CONTINUATION,
             max_matches: int = MAX_MATCHES) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """REST's draft for ``context`` (ending in the root): :func:`select_trie` of the continuations of
    the longest matching suffix, from ``store``, or from the context itself when ``store`` is None.
    Also returns the matched suffix length (0: nothing retrieved)."""
    empty = np.zeros(0, dtype=np.int64)
    if n_nodes <= 0 or len(context) < min_span:
        return empty, empty, empty, 0
    if store is None:
        span, starts = context_matches(context, max_span, min_span)
        conts = gather(np.asarray(context, dtype=np.int64), starts[:max_matches],
                       continuation) if span else None
    else:
        span, conts = store.longest_match(context, max_span, min_span), None
        while span >= min_span:  # the longest suffix with a non-empty continuation, as REST's loop over spans
            conts = store.continuations(context[len(context) - span :], continuation, max_matches)
            if len(conts):
                break
            span -= 1
    if conts is None or not len(conts) or span < min_span:
        return empty, empty, empty, 0
    tokens, parents, depths = select_trie(conts, n_nodes)
    return tokens, parents, depths, span


# ------------------------------------------------------------------------------------------- build
def build_datastore(texts: Iterable[str], tokenizer, depth: int = SORT_DEPTH, batch: int = 256) -> Datastore:
    """Tokenize ``texts`` (no special tokens) and index them; ``meta`` records the sizes, times and
    the tokenizer."""
    t0 = time.perf_counter()
    docs: list[list[int]] = []
    chunk: list[str] = []
    n_texts = 0
    for t in texts:
        if t:
            chunk.append(t)
            n_texts += 1
        if len(chunk) >= batch:
            docs += tokenizer(chunk, add_special_tokens=False).input_ids
            chunk = []
    if chunk:
        docs += tokenizer(chunk, add_special_tokens=False).input_ids
    t1 = time.perf_counter()
    store = Datastore.build(docs, depth)
    t2 = time.perf_counter()
    store.meta.update({"tokenize_s": round(t1 - t0, 3), "index_s": round(t2 - t1, 3),
                       "build_s": round(t2 - t0, 3),
                       "tokenizer": getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
                       "vocab_size": len(tokenizer), "bytes": store.nbytes})
    return store


def python_stdlib_texts(max_files: int | None = None) -> list[str]:
    """The sources of this Python's standard library (``*.py``; test suites and site-packages left out)."""
    import sysconfig

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))
    out = []
    for p in files[:max_files]:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def table_texts(path: str | os.PathLike, column: str) -> list[str]:
    """The strings of ``column`` of a Parquet / Arrow / JSONL / CSV table."""
    p = pathlib.Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(p, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        values = [r.get(column) for r in rows]
    else:
        import pyarrow as pa

        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(p, columns=[column])
        elif suffix == ".csv":
            import pyarrow.csv as pcsv

            table = pcsv.read_csv(p)
        elif suffix in (".arrow", ".feather", ".ipc"):
            import pyarrow.feather as feather

            table = feather.read_table(p)
        else:
            raise ValueError(f"{str(p)!r}: not a table (.parquet, .arrow, .jsonl, .csv)")
        if column not in table.column_names:
            raise ValueError(f"{str(p)!r} has no column {column!r} "
                             f"(columns: {', '.join(table.column_names)})")
        values = table.column(column).to_pylist()
        del pa
    return [v for v in values if isinstance(v, str) and v]


def _load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    from logitspec.models.loading import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(spec)), local_files_only=True)


def add_build_arguments(b: argparse.ArgumentParser) -> None:
    """The options of ``build`` (also ``logitspec rest-build``: then call :func:`run_build`)."""
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-python-stdlib", action="store_true",
                     help="this Python's standard library sources")
    src.add_argument("--from-table", metavar="PATH", help="a Parquet / Arrow / JSONL / CSV table")
    b.add_argument("--column", default="text", help="the table's text column (default: text)")
    b.add_argument("--max-files", type=int, default=None,
                   help="stdlib: the first N files only (default: all)")
    b.add_argument("--model", default="default",
                   help="whose tokenizer (a logitspec model spec; default: default)")
    b.add_argument("--out", required=True, help="output directory")


def run_build(args: argparse.Namespace) -> int:
    """Build the datastore ``args`` name, print its build time, tokens and size on disk; 2 if no text."""
    t0 = time.perf_counter()
    stdlib = args.from_python_stdlib
    texts = python_stdlib_texts(args.max_files) if stdlib else table_texts(args.from_table, args.column)
    if not texts:
        print("no text found", file=sys.stderr)
        return 2
    read_s = time.perf_counter() - t0
    tok = _load_tokenizer(args.model)
    store = build_datastore(texts, tok)
    store.meta.update({"source": "python-stdlib" if stdlib else f"{args.from_table}#{args.column}",
                       "model": args.model, "read_s": round(read_s, 3)})
    size = store.save(args.out)
    m = store.meta
    print(f"datastore {args.out}: {m['documents']} documents, {m['tokens']} tokens, "
          f"{size / 2**20:.1f} MiB on disk; build {m['build_s']:.1f} s (tokenize {m['tokenize_s']:.1f} s, "
          f"suffix array {m['index_s']:.1f} s), "
          f"read {read_s:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m logitspec.spec_decode.rest build (--from-python-stdlib | --from-table PATH --column COL)
    --model SPEC --out DIR``: build a datastore, report its build time, tokens and size on disk."""
    ap = argparse.ArgumentParser(prog="python -m logitspec.spec_decode.rest",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_build_arguments(sub.add_parser("build", help="build a REST datastore from local text or code"))
    return run_build(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

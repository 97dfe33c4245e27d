"""Per-corpus reference indexes: read a text corpus, tokenize it once, index it as numpy arrays.

A corpus spec is ``PATH`` or ``PATH#COLUMN``:

* a text file (any suffix not listed below): one document;
* a Parquet / Arrow / JSONL / CSV file or a saved ``datasets`` directory: one document per row of
  ``COLUMN`` (default ``text``);
* a directory: every file in it (sorted, recursively, hidden files skipped), each read as above;
* an ``.npz`` file written by ``jobs/build_index.py``: a prebuilt index, used as is (its tokenizer
  fingerprint must match the job's model);
* a REST datastore directory (``meta.json``, ``tokens.npy``, ``suffixes.npy``: ``logitspec rest-build``):
  loaded memory-mapped and shared like an index (its tokenizer's vocabulary, and its fingerprint where
  recorded, must match the job's model); with ``--method rest`` drafts are retrieved from it.

The driver builds each index once and puts its arrays in the Ray object store once; actors get the
arrays zero-copy (read-only views of the node's shared memory), so a node holds one copy of each
index however many actors use it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import tempfile
import time

import numpy as np

from logitspec.spec_decode.ngram_index import CorpusIndex

from ..errors import ConfigError
from .inputs import TABLE_SUFFIXES, is_saved_dataset, open_file
from .output import new_file_mode

log = logging.getLogger("pipeline.io.reference")

INDEX_SUFFIX = ".npz"
META_KEY = "__meta__"
_PROBE = "The quick brown fox jumps over the lazy dog. 1234 + 56 = 1290; café, 東京.\n\tdef f(x):"


def tokenizer_fingerprint(tokenizer) -> str:
    """Short hash of the tokenizer's vocabulary size and of how it splits a probe text."""
    ids = tokenizer(_PROBE, add_special_tokens=False).input_ids
    return hashlib.sha1(json.dumps([len(tokenizer), ids]).encode()).hexdigest()[:16]


def split_spec(spec: str) -> tuple[pathlib.Path, str | None]:
    path, sep, column = spec.rpartition("#")
    if sep and path and "/" not in column:
        return pathlib.Path(path).expanduser(), column
    return pathlib.Path(spec).expanduser(), None


def read_documents(spec: str) -> list[str]:
    """Documents of a corpus spec (see the module docstring); ConfigError if unreadable or empty."""
    path, column = split_spec(spec)
    if not path.exists():
        raise ConfigError(f"reference corpus {str(path)!r} does not exist")
    col = column or "text"
    if is_saved_dataset(path):
        docs = _column_docs(path, col)
    elif path.is_file():
        docs = _docs_of_file(path, col)
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        docs = [d for f in files for d in _docs_of_file(f, col)]
    docs = [d for d in docs if d]
    if not docs:
        raise ConfigError(f"reference corpus {spec!r} holds no text")
    return docs


def _column_docs(path: pathlib.Path, col: str) -> list[str]:
    f = open_file(path)
    if col not in f.names:
        raise ConfigError(f"reference corpus {str(path)!r} has no column {col!r} (columns: "
                          f"{', '.join(f.names)}); "
                          f"name one with {path}#COLUMN")
    return [v for t in f.batches([col]) for v in t.column(col).to_pylist() if isinstance(v, str)]


def _docs_of_file(path: pathlib.Path, col: str) -> list[str]:
    if path.suffix.lower() in TABLE_SUFFIXES:
        return _column_docs(path, col)
    try:
        return [path.read_text(encoding="utf-8")]
    except UnicodeDecodeError:
        log.warning("skipping %s in a reference corpus: not UTF-8 text", path)
        return []


def build_index(docs: list[str], tokenizer, max_ngram: int = 3) -> CorpusIndex:
    ids = tokenizer(docs, add_special_tokens=False).input_ids
    return CorpusIndex.build(ids, max_ngram=max_ngram)


def index_arrays(index: CorpusIndex, meta: dict) -> dict[str, np.ndarray]:
    """The index's arrays plus its metadata (as a uint8 array), ready for ``np.savez``/the object store."""
    d = dict(index.to_arrays())
    d[META_KEY] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return d


def split_meta(arrays) -> tuple[dict[str, np.ndarray], dict]:
    meta = json.loads(bytes(arrays[META_KEY]).decode()) if META_KEY in arrays else {}
    return {k: arrays[k] for k in arrays if k != META_KEY}, meta


def save_index(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez`` written to a temporary sibling and renamed: never a half-written index file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, new_file_mode())
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def load_index_file(path: pathlib.Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the index file {str(path)!r}: {e}") from None


def load_datastore(name: str, path: pathlib.Path, tokenizer, fp: str, t0: float) -> dict[str, np.ndarray]:
    """A REST datastore directory's arrays (with metadata), checked against ``tokenizer``."""
    from logitspec.spec_decode.rest import Datastore

    try:
        store = Datastore.load(path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot read the REST datastore {str(path)!r}: {e}") from None
    meta = dict(store.meta)
    vocab, recorded = meta.get("vocab_size"), meta.get("fingerprint")
    if (recorded is not None and recorded != fp) or (vocab is not None and vocab != len(tokenizer)):
        raise ConfigError(f"REST datastore {str(path)!r} was built with another tokenizer "
                          f"({meta.get('tokenizer')}, vocabulary {vocab}; the model's has {len(tokenizer)}); "
                          f"rebuild it with logitspec rest-build --model <the job's --model>")
    meta.update(name=name, source=str(path), tokenizer=fp, datastore=True, prebuilt=True,
                load_s=time.perf_counter() - t0)
    plain = store.to_arrays()
    meta["bytes"] = int(sum(a.nbytes for a in plain.values()))
    plain[META_KEY] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return plain


def _built_datastore(name: str, spec: str, docs: list[str], tokenizer, fp: str, t0: float
                     ) -> dict[str, np.ndarray]:
    """A REST datastore of ``docs`` built now, as arrays with metadata."""
    from logitspec.spec_decode.rest import build_datastore

    store = build_datastore(docs, tokenizer)
    plain = store.to_arrays()
    meta = {**store.meta, "name": name, "source": spec, "tokenizer": fp, "datastore": True, "prebuilt": False,
            "bytes": int(sum(a.nbytes for a in plain.values())), "build_s": time.perf_counter() - t0}
    plain[META_KEY] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return plain


def prepare_reference(name: str, spec: str, tokenizer, max_ngram: int = 3,
                      datastore: bool = False) -> dict[str, np.ndarray]:
    """Arrays (with metadata) of one corpus: a prebuilt ``.npz`` or REST datastore directory checked
    against ``tokenizer``, or built from the corpus text now (a REST datastore with ``datastore``, for
    ``--method rest``; else an n-gram index)."""
    t0 = time.perf_counter()
    fp = tokenizer_fingerprint(tokenizer)
    path, _ = split_spec(spec)
    if path.is_dir() and (path / "meta.json").is_file() and (path / "suffixes.npy").is_file():
        return load_datastore(name, path, tokenizer, fp, t0)
    if path.suffix.lower() == INDEX_SUFFIX and path.is_file():
        arrays = load_index_file(path)
        plain, meta = split_meta(arrays)
        if "tokens" not in plain:
            raise ConfigError(f"{str(path)!r} is not an index written by jobs/build_index.py")
        if meta.get("tokenizer") != fp:
            raise ConfigError(f"index {str(path)!r} was built with another tokenizer (fingerprint "
                              f"{meta.get('tokenizer')}, the model's is {fp}); rebuild it with the job's "
                              f"--model")
        meta.update(name=name, load_s=time.perf_counter() - t0, prebuilt=True)
        return index_arrays(CorpusIndex.from_arrays(plain), meta)
    docs = read_documents(spec)
    if datastore:
        return _built_datastore(name, spec, docs, tokenizer, fp, t0)
    index = build_index(docs, tokenizer, max_ngram)
    plain = index.to_arrays()
    meta = {"name": name, "source": spec, "documents": len(docs),
            "tokens": int(len(index.tokens) - len(docs)),
            "max_ngram": max_ngram, "tokenizer": fp, "vocab_size": len(tokenizer),
            "bytes": int(sum(a.nbytes for a in plain.values())), "build_s": time.perf_counter() - t0,
            "prebuilt": False}
    return index_arrays(index, meta)

"""A job with ``--method rest`` and a REST datastore as its corpus's reference (``--reference NAME=DIR``):
loaded once in the driver, shared through Ray's object store, a :class:`logitspec.spec_decode.rest.Datastore`
in
every replica; the output equals plain decoding's (lossless)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_pipeline import _cfg, _reference_job, ray_session, tiny  # noqa: F401 - fixtures
from transformers import AutoTokenizer

from logitspec.spec_decode.rest import Datastore, build_datastore
from pipeline.errors import ConfigError
from pipeline.io.output import read_generations
from pipeline.io.reference import prepare_reference, split_meta


def _method(cfg, method):
    gen = dataclasses.replace(cfg.gen, engine=dataclasses.replace(cfg.gen.engine, method=method))
    return dataclasses.replace(cfg, gen=gen)


def test_rest_job_shares_a_datastore_and_is_lossless(tmp_path, tiny, ray_session):  # noqa: F811
    import json

    import ray

    from pipeline.job.run import run_job
    from pipeline.replica.startup import attach_references

    inp, corpus, base, gens = _reference_job(tmp_path, tiny)
    tok = AutoTokenizer.from_pretrained(tiny)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    store_dir = tmp_path / "store"
    build_datastore(texts, tok).save(store_dir)
    ar = run_job(_method(_cfg(tiny, inp, tmp_path / "ar", max_new_tokens=24, corpus_column="corpus"), "ar"))
    rest = run_job(_method(_cfg(tiny, inp, tmp_path / "rest", max_new_tokens=24, corpus_column="corpus",
                                references=(("notes", str(store_dir)),)), "rest"))
    want = {r["id"]: r["generation"] for r in read_generations(tmp_path / "ar").to_pylist()}
    got = {r["id"]: r["generation"] for r in read_generations(tmp_path / "rest").to_pylist()}
    assert got == want == gens
    notes = rest["mat"]["per_corpus_now"]["notes"]
    assert notes["reference"] is True and notes["mat"] > ar["mat"]["per_corpus_now"]["notes"]["mat"]
    assert rest["memory"]["reference_zero_copy"] is True
    report = (tmp_path / "rest" / "_report.md").read_text()  # written at the end of every job
    assert "rest" in report and (tmp_path / "rest" / "_report" / "mat_hist.png").is_file()
    # what a replica attaches: the datastore itself, zero-copy
    arrays = prepare_reference("notes", str(store_dir), tok)
    plain, meta = split_meta(arrays)
    assert Datastore.holds(plain) and meta["datastore"] and meta["documents"] == 6
    indexes, held = attach_references({"notes": (ray.put(arrays),)})
    assert isinstance(indexes["notes"], Datastore) and held["reference_zero_copy"] is True
    assert np.array_equal(indexes["notes"].tokens, Datastore.load(store_dir).tokens)


def test_datastore_of_another_tokenizer_is_refused(tmp_path, tiny):  # noqa: F811
    tok = AutoTokenizer.from_pretrained(tiny)
    build_datastore(["some text to index", "more text"], tok).save(tmp_path / "store")
    other = type("OtherTokenizer", (), {"__len__": lambda self: 7, "__call__": lambda self, t, **k: type(
        "Enc", (), {"input_ids": [1, 2]})()})()
    with pytest.raises(ConfigError, match="another tokenizer"):
        prepare_reference("notes", str(tmp_path / "store"), other)


def test_text_corpus_built_as_a_datastore_in_the_driver(tmp_path, tiny):  # noqa: F811
    """``prepare_reference(..., datastore=True)``: what the driver builds for ``--method rest`` from text."""
    tok = AutoTokenizer.from_pretrained(tiny)
    (tmp_path / "corpus.txt").write_text("permission is hereby granted, free of charge, to any person")
    plain, meta = split_meta(prepare_reference("notes", str(tmp_path / "corpus.txt"), tok, datastore=True))
    assert Datastore.holds(plain) and meta["datastore"] and not meta["prebuilt"] and meta["documents"] == 1
    store = Datastore.from_arrays(plain, meta)
    assert store.longest_match(tok("permission is hereby", add_special_tokens=False).input_ids) > 0

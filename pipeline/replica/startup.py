"""Setting up one replica process: dtype, model, the shared reference indexes, engine, warm-up.

Both kinds of replica use :func:`set_up`: an :class:`pipeline.replica.actor.EngineWorker` (one process holds
the model) and a :class:`pipeline.replica.tp.TPRank` (one rank of a tensor-parallel group holds its shard).
They differ only in how the model is loaded and how the engine is made, which they pass in.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from logitspec import allocator
from logitspec.engine.request import Request

from ..spec import GenerationSpec
from .resources import array_spans, peak_rss, tensor_spans, where_bytes_live


def torch_dtype(name: str, device: str):
    """``--dtype`` as a torch dtype; ``auto``: bfloat16 on a GPU, float32 on the CPU."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def model_memory(model) -> dict:
    """Bytes of the model's parameters and buffers, and where they live: ``model_private_bytes``
    (anonymous memory of this process: a copy of its own), ``model_device_bytes`` (a GPU: also its
    own), ``model_shared_bytes`` / ``model_file_bytes`` (mappings other processes can share)."""
    tensors = list(model.parameters()) + list(model.buffers())
    where = where_bytes_live(tensor_spans(tensors))
    return {"model_bytes": int(sum(t.numel() * t.element_size() for t in tensors)),
            "model_private_bytes": where["private"], "model_device_bytes": where["device"],
            "model_shared_bytes": where["shared"], "model_file_bytes": where["file"]}


def attach_references(reference_refs: dict) -> tuple[dict, dict]:
    """The shared indexes (``{name: CorpusIndex or REST Datastore}``) and what this process holds of them.

    ``reference_refs``: ``{name: (ObjectRef,)}`` (1-tuples: Ray must not resolve them for us). An
    index is zero-copy when its arrays are read-only views that own no data and lie in no private
    memory of this process: ``ray.get`` mapped the node's object-store copy. Per index: its bytes, the
    bytes of it in private memory (a copy of this process's own) and in shared mappings."""
    import ray

    from logitspec.spec_decode.ngram_index import CorpusIndex
    from logitspec.spec_decode.rest import Datastore

    from ..io.reference import split_meta

    indexes, held = {}, {}
    for name, (ref,) in reference_refs.items():
        arrays, meta = split_meta(ray.get(ref))
        where = where_bytes_live(array_spans(arrays.values()))
        views = all(not a.flags.writeable and not a.flags.owndata for a in arrays.values())
        held[name] = {"bytes": int(sum(a.nbytes for a in arrays.values())), "private_bytes": where["private"],
                      "shared_bytes": where["shared"], "zero_copy": views and where["private"] == 0}
        # a REST datastore (--reference NAME=DIR of python -m logitspec.spec_decode.rest build) or an n-gram
        # index
        indexes[name] = (Datastore.from_arrays(arrays, meta) if Datastore.holds(arrays)
                         else CorpusIndex.from_arrays(arrays))
    zero_copy = all(h["zero_copy"] for h in held.values()) if held else None
    return indexes, {"reference_zero_copy": zero_copy, "references": held, "reference_names": sorted(indexes)}


def warm_up(engine, tokenizer) -> None:
    """A 2-token generation: the first forwards allocate; keep that out of the measured generation time."""
    ids = engine.encode("Hello, world.") if tokenizer is not None else [1, 2, 3]
    engine.generate([ids], Request(max_new_tokens=2))


def set_up(spec: GenerationSpec, device: str, reference_refs: dict, make_engine: Callable, load: Callable):
    """``(RowGenerator, info)`` of one replica process.

    ``load(dtype) -> (model, tokenizer)`` loads the model (or this rank's shard) on ``device``;
    ``make_engine(model, tokenizer, spec_config, history) -> engine`` (``history``: the replica's
    :class:`~logitspec.spec_decode.history.HistorySource` of its own answers, or None). ``info``: device,
    dtype, threads,
    the time of each step, the model's and the indexes' bytes and where they live, the peak RSS."""
    import torch

    from .worker import RowGenerator

    t0 = time.perf_counter()
    dtype = torch_dtype(spec.dtype, device)
    model, tokenizer = load(dtype)
    if spec.chat_template is not None and tokenizer is not None:  # the job's, over the tokenizer's own
        tokenizer.chat_template = spec.chat_template
    t_load = time.perf_counter()
    references, held = attach_references(reference_refs)
    t_refs = time.perf_counter()
    engine = make_engine(model, tokenizer, spec.engine, spec.history_source())
    if spec.warmup:
        warm_up(engine, tokenizer)
    t_warm = time.perf_counter()
    info = {"device": device, "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
            "tcmalloc": allocator.loaded(),
            "model_load_s": t_load - t0, "reference_attach_s": t_refs - t_load, "warmup_s": t_warm - t_refs,
            **model_memory(model), **held, "peak_rss_bytes": peak_rss()}
    return RowGenerator(engine, spec, references), info

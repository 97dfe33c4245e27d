"""Which model runner an engine gets: the graph runner on CUDA (slots sized to the device's memory), the
eager runner elsewhere, or the one a configuration names (``SpecConfig.runner``)."""
from __future__ import annotations

import torch

from logitspec.worker.eager_runner import EagerRunner
from logitspec.worker.gpu.graph_runner import ENGINE_ATTENTION, GraphRunner
from logitspec.worker.gpu.step import NODE_BUCKETS
from logitspec.worker.kv_cache import kv_bytes_per_token


def runner_for(model, config, fast_head: bool = True, sharded_head: bool = False):
    """The model runner ``config.runner`` names for an engine of ``config.max_batch_size`` rows:
    ``auto`` (:func:`default_runner`), ``eager`` (:class:`EagerRunner`), ``graph`` (a
    :class:`GraphRunner`; off CUDA its static path without capture, attending with SDPA) or
    ``compiled`` (the same, its steps compiled). ``sharded_head``: a tensor-parallel rank's (the
    eager runner, or with ``graph`` the graph runner, its greedy steps decided inside the step and
    captured with their collectives on CUDA; never compiled)."""
    if sharded_head:
        if config.runner == "compiled":
            raise ValueError("a tensor-parallel rank runs --runner auto, eager or graph, not compiled")
        if config.runner != "graph":
            return EagerRunner(model, sharded_head=True)
        # SDPA: it has a kernel for every shape, where flex attention's may fail on one rank alone
        # (Gemma 3's attention is all on rank 0), and a rank never falls back alone
        return GraphRunner(model, max_rows=config.max_batch_size, max_len=slot_columns(model),
                           attention="sdpa", sharded_head=True, decide_top=decision_top(config))
    if config.runner == "eager" or not fast_head:
        return EagerRunner(model, fast_head=fast_head)
    compiled = config.runner == "compiled"
    if config.runner in ("graph", "compiled") and next(model.parameters()).device.type != "cuda":
        columns = -(-slot_columns(model) // 128) * 128  # flex attention's block
        # SDPA: flex attention off CUDA is its unfused reference (every score materialized, per layer)
        return GraphRunner(model, max_rows=config.max_batch_size, max_len=columns, compile=compiled)
    return default_runner(model, config.max_batch_size, compile=compiled, decide_top=decision_top(config))


def decision_top(config) -> int:
    """The top tokens a greedy step decided inside the graph runner's step keeps of its last node's
    scores: the bonus token and ``top_k`` next-next guesses where the method drafts from guesses
    (logitspec), none otherwise."""
    from logitspec.spec_decode.drafters import drafter_class

    return config.top_k + 1 if drafter_class(config.method).wants_guesses else 0


def slot_columns(model) -> int:
    """A slot's columns for ``model``: its context, at most 8192, and room for the largest node bucket."""
    cfg = model.config.get_text_config(decoder=True)
    return min(int(getattr(cfg, "max_position_embeddings", 8192)), 8192) + max(NODE_BUCKETS)


def default_runner(model, max_rows: int, max_len: int | None = None, fast_head: bool = True,
                   memory_share: float = 0.5, **kw):
    """The runner an engine should use for ``model``: a :class:`GraphRunner` on CUDA (``kw``: its
    keywords; the engine's decides greedy steps inside the step, :func:`decision_top`), the eager
    :class:`~logitspec.worker.eager_runner.EagerRunner` elsewhere. ``max_len`` (default: the model's context,
    at most 8192, plus the largest node bucket) is cut so that the slots take at most
    ``memory_share`` of the device's free memory."""
    first = next(model.parameters())
    if first.device.type != "cuda" or not fast_head:
        return EagerRunner(model, fast_head=fast_head)
    if max_len is None:
        max_len = slot_columns(model)
    free = torch.cuda.mem_get_info(first.device)[0]
    max_len = min(max_len, int(memory_share * free) // (kv_bytes_per_token(model) * max_rows))
    max_len = max_len // 128 * 128  # flex attention's block
    if max_len < 128 + max(NODE_BUCKETS):
        raise ValueError(f"{max_rows} slots leave room for {max_len} columns each")
    return GraphRunner(model, max_rows=max_rows, max_len=max_len, **{"attention": ENGINE_ATTENTION, **kw})

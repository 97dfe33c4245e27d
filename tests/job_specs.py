"""A job's :class:`~pipeline.spec.GenerationSpec` in one call, for tests: the decoding settings among the
keywords (``max_new_tokens``, ``temperature``, ``seed``, ``n`` ...) go into its request, the engine's
(``method``, ``budget``, ``max_batch_size``) into its :class:`~logitspec.config.SpecConfig`."""
from logitspec.engine.request import SAMPLING_FIELDS, Request
from pipeline.spec import DEFAULT_MAX_NEW_TOKENS, GenerationSpec, engine_config

ENGINE_FIELDS = ("method", "budget", "max_batch_size")


def job_spec(**kw) -> GenerationSpec:
    fields = {k: kw.pop(k) for k in list(kw) if k in Request.__dataclass_fields__ or k in SAMPLING_FIELDS}
    engine = {k: kw.pop(k) for k in ENGINE_FIELDS if k in kw}
    request = Request.make(**{"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "seed": 0, **fields})
    base = GenerationSpec().engine
    engine = engine_config(**{**{k: getattr(base, k) for k in ENGINE_FIELDS}, **engine}) if engine else base
    return GenerationSpec(request=request, engine=engine, **kw)

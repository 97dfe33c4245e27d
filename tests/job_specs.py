"""A job's :class:`~pipeline.job.config.GenerationSpec` in one call, for tests: the decoding settings
among the keywords (``max_new_tokens``, ``temperature``, ``seed``, ``n`` ...) go into its request."""
from logitspec.engine.request import Request
from pipeline.job.config import DEFAULT_MAX_NEW_TOKENS, GenerationSpec


def job_spec(**kw) -> GenerationSpec:
    fields = {k: kw.pop(k) for k in list(kw) if k in Request.__dataclass_fields__}
    return GenerationSpec(request=Request(**{"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "seed": 0, **fields}),
                          **kw)

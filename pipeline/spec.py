"""What one replica is built from: the model, the engine's :class:`~logitspec.config.SpecConfig` and the
job's :class:`~logitspec.engine.request.Request` (the decoding settings every row is generated with, ``n``
its samples per row). The job makes it; every replica gets it (picklable)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from logitspec.config import SpecConfig
from logitspec.engine.request import Request

from .errors import ConfigError


def engine_config(**settings) -> SpecConfig:
    """The engine's :class:`SpecConfig` of ``settings``; ConfigError for bad ones."""
    try:
        return SpecConfig(**settings)
    except ValueError as e:
        raise ConfigError(str(e)) from None

DTYPES = ("auto", "float32", "bfloat16", "float16")
TRUNCATE = ("error", "left", "middle")  # what a prompt longer than the model's context gets (--truncate)
DEFAULT_MAX_NEW_TOKENS = 64  # the job's --max-new-tokens


@dataclass(frozen=True)
class GenerationSpec:
    """What one replica needs to turn rows into generations (picklable, sent to every actor)."""

    model: str = "default"
    # the engine's settings: method, draft budget ("auto" or "fixed"), max_batch_size (rows per forward)
    engine: SpecConfig = field(default_factory=lambda: SpecConfig(method="logitspec", max_batch_size=4))
    # the decoding settings of every row; seed: the base of the rows' seeds (row_seed), n: samples per row
    request: Request = field(default_factory=lambda: Request(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, seed=0))
    chat: bool = False
    # a Jinja chat template for tokenizers without one, or to use instead of theirs (--chat-template)
    chat_template: str | None = None
    # a prompt that leaves no room for max_new_tokens in the context: "error" (an error row when it does
    # not fit at all), or cut to fit, keeping its end ("left") or both ends ("middle", as LongBench)
    truncate: str = "error"
    dtype: str = "auto"
    warmup: bool = True
    trust_remote_code: bool = False  # let transformers run code shipped with the model (--trust-remote-code)
    # answers kept per replica as a draft source, in tokens (--history-tokens; 0: none)
    history_tokens: int = 0
    share_history: bool = False  # replicas' histories also hold the other replicas' answers (--share-history)
    # what the output's ``model`` column says: the resolved model and a short hash of its files, set by the
    # job's planning (pipeline.io.model.model_label); None: the --model value as given
    model_label: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.engine, SpecConfig):
            raise ConfigError(f"engine must be a logitspec.config.SpecConfig, got "
                              f"{type(self.engine).__name__}")
        if not isinstance(self.request, Request):
            raise ConfigError(f"request must be a logitspec.engine.request.Request, got "
                              f"{type(self.request).__name__}")
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self.request.sampling, name)):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got "
                                  f"{getattr(self.request.sampling, name)}")
        if self.request.seed is None:
            raise ConfigError("the job's request needs a seed: the base of every row's seed")
        if self.history_tokens < 0:
            raise ConfigError(f"history_tokens must be >= 0, got {self.history_tokens}")
        if self.share_history and not self.history_tokens:
            raise ConfigError("--share-history needs a history: set --history-tokens N (e.g. 20000)")
        if self.truncate not in TRUNCATE:
            raise ConfigError(f"truncate must be one of {', '.join(TRUNCATE)}, got {self.truncate!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def method(self) -> str:
        return self.engine.method

    def history_source(self):
        """A fresh :class:`~logitspec.spec_decode.history.HistorySource` of ``history_tokens`` tokens, or
        None."""
        if not self.history_tokens:
            return None
        from logitspec.spec_decode.history import HistorySource

        return HistorySource(max_tokens=self.history_tokens)

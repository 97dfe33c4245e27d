"""An evaluation sweep's configuration: the grid of engine configurations and the job's settings.

A :class:`SweepConfig` is one point of the grid (a method and engine settings); its ``name``
(``logitspec``, ``ar@max_batch_size=4``, ...) names its rows in the output. Settings a method does
not use are dropped from its configurations, so ``ar`` is not run twice for two draft budgets.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from logitspec.config import METHODS, SpecConfig

from ..errors import ConfigError
from ..job.config import JobConfig
from ..spec import DTYPES

# setting -> (type, the methods it applies to)
GRID_KEYS: dict[str, tuple[type, tuple[str, ...]]] = {
    "max_batch_size": (int, METHODS),
    "prefill_chunk": (int, METHODS),
    "budget": (str, ("logitspec",)),
    "capacity": (int, ("logitspec",)),
    "top_k": (int, ("logitspec",)),
    "pld_max_tokens": (int, ("pld",)),
}
BASELINE = "ar"


@dataclass(frozen=True)
class SweepConfig:
    """One configuration of the grid: ``method`` and the engine settings that apply to it."""

    method: str
    settings: tuple[tuple[str, object], ...] = ()  # sorted (key, value) pairs

    @property
    def name(self) -> str:
        return self.method + "".join(f"@{k}={v}" for k, v in self.settings)

    @property
    def baseline(self) -> SweepConfig:
        """The ``ar`` configuration with the same settings that apply to ``ar`` (its speed-up reference)."""
        return SweepConfig(BASELINE, tuple((k, v) for k, v in self.settings if BASELINE in GRID_KEYS[k][1]))

    def spec_config(self, default_batch: int) -> SpecConfig:
        fields = {k: v for k, v in self.settings if k != "prefill_chunk"}
        fields.setdefault("max_batch_size", default_batch)
        return SpecConfig(method=self.method, **fields)

    @property
    def prefill_chunk(self) -> int | None:
        return dict(self.settings).get("prefill_chunk")

    def as_dict(self) -> dict:
        return {"name": self.name, "method": self.method, "settings": dict(self.settings),
                "baseline": self.baseline.name}


def parse_grid(items: list[str]) -> dict[str, list]:
    """``["max_batch_size=1,4", "budget=auto,fixed"]`` -> ``{"max_batch_size": [1, 4], ...}``."""
    grid: dict[str, list] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in GRID_KEYS:
            raise ConfigError(f"--grid {item!r}: expected KEY=V1,V2,... with KEY one of "
                              f"{', '.join(GRID_KEYS)}")
        kind = GRID_KEYS[key][0]
        try:
            parsed = [kind(v.strip()) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"--grid {item!r}: {key} takes {kind.__name__} values") from None
        if not parsed or key in grid:
            raise ConfigError(f"--grid {item!r}: give each key once, with at least one value")
        grid[key] = list(dict.fromkeys(parsed))
    return grid


def expand_grid(methods: list[str], grid: dict[str, list], default_batch: int) -> list[SweepConfig]:
    """Every method x every combination of the settings that apply to it, in order, without repeats;
    each configuration checked (a bad value is a :class:`ConfigError` before anything runs)."""
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ConfigError(f"--methods: unknown {bad or 'none given'}; choose from {', '.join(METHODS)}")
    configs: list[SweepConfig] = []
    for method in dict.fromkeys(methods):
        keys = [k for k in grid if method in GRID_KEYS[k][1]]
        for values in itertools.product(*(grid[k] for k in keys)):
            c = SweepConfig(method, tuple(sorted(zip(keys, values))))
            try:
                c.spec_config(default_batch)
            except ValueError as e:
                raise ConfigError(f"configuration {c.name}: {e}") from None
            if c.prefill_chunk is not None and c.prefill_chunk < 1:
                raise ConfigError(f"configuration {c.name}: prefill_chunk must be >= 1")
            if c not in configs:
                configs.append(c)
    return configs


@dataclass(frozen=True)
class EvalConfig:
    """A whole sweep (see ``python jobs/eval.py --help``)."""

    data: str
    output: str
    model: str = "default"
    methods: tuple[str, ...] = ("ar", "logitspec")
    grid: tuple[str, ...] = ()  # --grid items, parsed by parse_grid
    datasets: tuple[str, ...] = ()  # () = every dataset file in --data
    limit: int | None = None  # the first N rows of each dataset
    max_new_tokens: int | None = None  # cap on each dataset's own maximum
    max_length: int | None = None  # prompt tokens kept (middle truncation); None: context - answer - margin
    chat: str = "auto"  # "auto": the dataset's rule when the tokenizer has a template; "never"
    max_batch_size: int = 1  # engine batch unless the grid sets max_batch_size
    prefix_cache_gb: float = 4.0  # prefilled rows kept for the other configurations (0: none)
    dtype: str = "auto"
    warmup: bool = True
    trust_remote_code: bool = False
    actors: int = 1
    cpus_per_actor: float | None = None
    threads_per_actor: int | None = None
    batch_rows: int | None = None  # rows per actor task; None: 2 x the largest engine batch
    overwrite: bool = False
    address: str | None = None
    log_interval: float = 10.0
    max_replacements: int | None = None
    configs: tuple[SweepConfig, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.data or not self.output:
            raise ConfigError("--data and --output are required")
        for name in ("limit", "max_new_tokens", "max_length", "batch_rows", "threads_per_actor"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.max_batch_size < 1 or self.actors < 1:
            raise ConfigError("--max-batch-size and --actors must be >= 1")
        if not self.prefix_cache_gb >= 0:
            raise ConfigError(f"--prefix-cache-gb must be >= 0, got {self.prefix_cache_gb}")
        if self.chat not in ("auto", "never"):
            raise ConfigError(f"--chat must be auto or never, got {self.chat!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        configs = expand_grid(list(self.methods), parse_grid(list(self.grid)), self.max_batch_size)
        object.__setattr__(self, "configs", tuple(configs))

    @property
    def largest_batch(self) -> int:
        return max(c.spec_config(self.max_batch_size).max_batch_size for c in self.configs)

    @property
    def rows_per_batch(self) -> int:
        return self.batch_rows or 2 * self.largest_batch

    def job_config(self, rows_dir: str) -> JobConfig:
        """The batch job's settings the sweep shares (Ray, resources, replacements), for the job's helpers."""
        return JobConfig(input=self.data, output=rows_dir, actors=self.actors,
                         cpus_per_actor=self.cpus_per_actor,
                         threads_per_actor=self.threads_per_actor, address=self.address,
                         log_interval=self.log_interval, max_replacements=self.max_replacements)

    def record(self) -> dict:
        """Settings that decide a row's output (a resumed sweep must use the same; configurations may
        change)."""
        return {"model": self.model, "max_new_tokens": self.max_new_tokens, "max_length": self.max_length,
                "max_batch_size": self.max_batch_size,
                "chat": self.chat, "dtype": self.dtype, "temperature": 0.0}

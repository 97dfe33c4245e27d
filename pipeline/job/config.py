"""The job's configuration: one frozen dataclass, validated at construction (before Ray starts).

``JobConfig`` holds everything the driver needs; its ``gen`` (:class:`~pipeline.spec.GenerationSpec`)
is the part each replica is built from.
"""
from __future__ import annotations

import pathlib
import re
from dataclasses import asdict, dataclass, field

from logitspec.engine.request import Request

from ..errors import ConfigError
from ..io.row_checks import MAX_ROW_SAMPLES, REQUEST_COLUMNS  # noqa: F401 - the job's names for them
from ..spec import GenerationSpec

INPUT_FORMATS = ("auto", "table", "openai")
OUTPUT_FORMATS = ("parquet", "openai")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class JobConfig:
    """A whole batch-generation job (see ``python jobs/generate.py --help``)."""

    input: str
    output: str
    gen: GenerationSpec = field(default_factory=GenerationSpec)
    prompt_column: str = "prompt"
    id_column: str = "id"
    messages_column: str | None = None
    corpus_column: str | None = None
    split: str | None = None  # for a saved datasets.DatasetDict
    # "auto" (an OpenAI batch file is recognised), "table", or "openai" (pipeline.io.openai_batch)
    input_format: str = "auto"
    # "parquet", or "openai": the Parquet dataset and an OpenAI batch results file (--results)
    output_format: str = "parquet"
    results: str | None = None  # the OpenAI results file; None: <output>/_results.jsonl
    limit: int | None = None  # only the first N input rows (the job's input is then those rows)
    # (name, path) pairs; name "default" when given without a name
    references: tuple[tuple[str, str], ...] = ()
    # input columns holding a row's own decoding settings (REQUEST_COLUMNS); a null keeps the job's
    request_columns: tuple[str, ...] = ()
    # input columns copied into the output rows (--keep-columns): "all" (every input column but the id and
    # those named like an output column), "none", or "col1,col2" (a name of an output column is refused)
    keep_columns: str = "all"
    actors: int = 1
    # tensor-parallel shards per replica: N actors on one node (pipeline/replica/tp.py); resources per shard
    tp: int = 1
    cpus_per_actor: float | None = None  # None: all local CPUs / actors when Ray is started here, else 1
    gpus_per_actor: float = 0.0
    # torch threads per actor; None: the CPUs Ray gives the actor (at least 1). Threads beyond the CPUs an
    # actor holds contend with the other actors (2 threads ran 10x slower than 1 on a shared core,
    # docs/pipeline.md).
    threads_per_actor: int | None = None
    batch_rows: int | None = None  # rows per actor task; None: 2 * max_batch_size
    # one-actor replicas keep one engine session across tasks (pipeline/streaming.py); False: task by task
    stream: bool = True
    part_rows: int = 10_000  # the driver writes a part file per this many finished rows ...
    part_seconds: float = 60.0  # ... or when its oldest buffered row is this old (and at the end)
    overwrite: bool = False
    allow_foreign_files: bool = False  # run on an --output that holds files of others (warned, left alone)
    address: str | None = None  # Ray address; None: $RAY_ADDRESS, else start a local Ray
    log_interval: float = 10.0
    max_replacements: int | None = None  # actor deaths replaced before the job gives up; None: 3 + 2 * actors
    max_row_attempts: int = 2  # a single row that kills its actor this many times becomes an error row
    batch_timeout_s: float | None = 3600.0  # a replica silent this long with work in flight is given up
    start_timeout_s: float | None = 3600.0  # ... and one not ready this long after it was asked for

    def __post_init__(self) -> None:
        if not self.input:
            raise ConfigError("--input is required")
        if not self.output:
            raise ConfigError("--output is required")
        for name in ("actors", "tp", "max_row_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.tp > 1 and self.gen.engine.runner == "compiled":
            raise ConfigError(f"--runner compiled is for one model per replica: tensor-parallel replicas "
                              f"(--tp {self.tp}) run the eager runner or the graph runner's static path "
                              "uncaptured (--runner graph); drop --runner compiled or --tp")
        for name in ("batch_rows", "threads_per_actor", "limit", "part_rows"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.cpus_per_actor is not None and not self.cpus_per_actor > 0:
            raise ConfigError(f"--cpus-per-actor must be > 0, got {self.cpus_per_actor}")
        if not self.gpus_per_actor >= 0:
            raise ConfigError(f"--gpus-per-actor must be >= 0, got {self.gpus_per_actor}")
        for name in ("batch_timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ConfigError(f"{flag} must be > 0 (0 on the command line: no limit), got {value}")
        if self.max_replacements is not None and self.max_replacements < 0:
            raise ConfigError(f"--max-replacements must be >= 0, got {self.max_replacements}")
        if not self.part_seconds > 0:
            raise ConfigError(f"--part-seconds must be > 0, got {self.part_seconds}")
        if not self.log_interval > 0:
            raise ConfigError(f"--log-interval must be > 0, got {self.log_interval}")
        names = [n for n, _ in self.references]
        if len(set(names)) != len(names):
            raise ConfigError(f"reference names must be unique, got {names}")
        for n in names:
            if not _NAME.match(n):
                raise ConfigError(f"reference name {n!r} may hold only letters, digits, '_', '.', '-'")
        if len(self.references) > 1 and not self.corpus_column:
            raise ConfigError("several --reference corpora need --corpus-column to say which one a row uses")
        if self.references and self.corpus_column and "default" in names and len(names) == 1:
            raise ConfigError("with --corpus-column, name the reference after the corpus it serves: "
                              "--reference NAME=PATH")
        bad = [c for c in self.request_columns if c not in REQUEST_COLUMNS]
        if bad or len(set(self.request_columns)) != len(self.request_columns):
            raise ConfigError(f"--request-columns takes distinct names among {', '.join(REQUEST_COLUMNS)}, "
                              f"got {', '.join(self.request_columns)}")
        if self.input_format not in INPUT_FORMATS:
            raise ConfigError(f"--input-format must be one of {', '.join(INPUT_FORMATS)}, got "
                              f"{self.input_format!r}")
        if self.output_format not in OUTPUT_FORMATS:
            raise ConfigError(f"--output-format must be one of {', '.join(OUTPUT_FORMATS)}, got "
                              f"{self.output_format!r}")
        if self.results is not None and self.output_format != "openai":
            raise ConfigError("--results names the OpenAI results file: it needs --output-format openai")
        results = pathlib.Path(self.results_path).expanduser()
        if (results.parent.resolve() == pathlib.Path(self.output).expanduser().resolve()
                and not results.name.startswith(("_", "."))):
            raise ConfigError(f"--results {self.results}: inside --output, name it _{results.name} "
                              f"(readers of the Parquet dataset skip _-named files), or put it elsewhere")
        if {self.prompt_column, self.id_column} & {self.messages_column, self.corpus_column} - {None}:
            raise ConfigError("the id, prompt, messages and corpus columns must differ")

    @property
    def request(self) -> Request:
        """The decoding settings of every row (the replicas' :attr:`GenerationSpec.request`)."""
        return self.gen.request

    @property
    def num_samples(self) -> int:
        """Output rows per input row (id, sample 0..N-1), each with its own seed: the request's ``n``."""
        return self.gen.request.n

    @property
    def results_path(self) -> str:
        """Where ``--output-format openai`` writes its results file."""
        return self.results or str(pathlib.Path(self.output) / "_results.jsonl")

    @property
    def rows_per_batch(self) -> int:
        return self.batch_rows or 2 * self.gen.engine.max_batch_size

    @property
    def replacements(self) -> int:
        return self.max_replacements if self.max_replacements is not None else 3 + 2 * self.actors

    def as_dict(self) -> dict:
        d = asdict(self)
        d["references"] = {n: p for n, p in self.references}
        d["gen"]["request"] = self.gen.request.to_dict()
        e = self.gen.engine  # the engine settings a job sets, flat beside the model (as summaries read them)
        d["gen"].pop("engine")
        d["gen"].update(method=e.method, budget=e.budget, max_batch_size=e.max_batch_size)
        return d


def parse_reference(text: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` (name ``default``). A PATH holding '=' needs the NAME= form."""
    name, sep, path = text.partition("=")
    if sep and _NAME.match(name):
        return name, path
    return "default", text

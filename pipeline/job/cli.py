"""Command line of ``logitspec job`` and ``jobs/generate.py``: flags -> :class:`JobConfig` -> :func:`run_job`.

Exit codes: 0 done (every input row is in the output), 2 the job could not start (bad flag, input,
model, reference or output dir; nothing ran), 1 it started but could not finish (see _summary.json).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from logitspec.config import METHODS, RUNNER_HELP, RUNNERS
from logitspec.engine.request import Request, add_request_flags, request_from_args
from logitspec.helpfmt import METHOD_HELP, DefaultsHelpFormatter

from ..errors import ConfigError
from ..io.model import read_chat_template
from ..spec import DEFAULT_MAX_NEW_TOKENS, DTYPES, TRUNCATE, GenerationSpec, engine_config
from .config import INPUT_FORMATS, OUTPUT_FORMATS, REQUEST_COLUMNS, JobConfig, parse_reference

log = logging.getLogger("pipeline.job.cli")

# shared decoding flags whose meaning the job refines (rows are seeded by id, samples resume)
JOB_MEANING = {
    "seed": "base seed; a row's seed is a stable hash of (seed, row id, sample), so it does not depend on "
            "batches, actors or resumes (default: %(default)s)",
    "num_samples": "samples per prompt: output rows (id, sample 0..N-1), each with its own seed; needs "
                   "--temperature > 0; raising it on resume adds the missing samples (default: %(default)s)",
}


DESCRIPTION = "Batch generation with LogitSpec speculative decoding on Ray: one output row per input row."


def _add_io_arguments(p: argparse.ArgumentParser) -> None:
    """The input and output flags."""
    io = p.add_argument_group("input and output")
    io.add_argument("--input", required=True,
                    help="Parquet / Arrow IPC / JSONL / CSV file or directory, or a saved datasets directory")
    io.add_argument("--output", required=True,
                    help="output directory, a Parquet dataset (part-*.parquet; _job.json, _summary.json)")
    io.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                    help="auto: an OpenAI batch file (JSONL of {custom_id, method, url, body}) is read as "
                         "one, other files as tables; openai or table to say which")
    io.add_argument("--output-format", choices=OUTPUT_FORMATS, default="parquet",
                    help="openai: also write the OpenAI batch results file (--results) from the Parquet "
                         "dataset, one line per request, at the end of every run")
    io.add_argument("--results", default=None, metavar="PATH",
                    help="the OpenAI results file (default: <output>/_results.jsonl)")
    io.add_argument("--part-rows", type=int, default=10_000, help="finished rows per part file")
    io.add_argument("--part-seconds", type=float, default=60.0,
                    help="write buffered rows as a part file at least this often (seconds)")
    io.add_argument("--prompt-column", default="prompt",
                    help="input column holding each row's prompt: text, or a list of token ids")
    io.add_argument("--id-column", default="id",
                    help="row ids; generated from row order when the column is absent")
    io.add_argument("--messages-column", default=None,
                    help="chat messages column (list of {role, content}); used instead of the prompt when "
                         "not null")
    io.add_argument("--request-columns", default="", metavar="COLS",
                    help=f"comma-separated input columns ({', '.join(REQUEST_COLUMNS)}) holding a row's own "
                         "decoding setting in place of the job's (null: the job's); seed is the row's base "
                         "seed, n its samples (in place of --num-samples), stop a string or a list")
    io.add_argument("--keep-columns", default="all", metavar="all|none|COLS",
                    help="input columns copied into every output row: all (every input column but the id and "
                         "those named like an output column), none, or a comma-separated list; with long "
                         "prompts, none or a list keeps the output small")
    io.add_argument("--corpus-column", default=None, help="column naming the reference corpus a row uses")
    io.add_argument("--split", default=None, help="split of a saved DatasetDict")
    io.add_argument("--limit", type=int, default=None, help="use only the first N input rows")
    io.add_argument("--overwrite", action="store_true", help="start over instead of resuming")
    io.add_argument("--allow-foreign-files", action="store_true",
                    help="run although --output holds files that are not this job's (left alone; readers of "
                         "the output dataset will trip on them); by default such a directory is refused")
    io.add_argument("--dry-run", action="store_true",
                    help="check and plan (rows to do after resume, batches, part files), print it, exit; "
                         "starts no Ray and writes nothing")


def _add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """The replicas' flags: where they run, how many, their resources and limits."""
    ray_ = p.add_argument_group("Ray")
    ray_.add_argument("--address", default=None,
                      help="Ray cluster to join (default: $RAY_ADDRESS, else start a local Ray)")
    ray_.add_argument("--actors", type=int, default=1, help="model replicas (one actor each)")
    ray_.add_argument("--tp", type=int, default=1,
                      help="tensor-parallel shards per replica (DeepSpeed AutoTP): each replica is N actors "
                           "on one node; --cpus/--gpus/--threads-per-actor are then per shard")
    ray_.add_argument("--cpus-per-actor", type=float, default=None,
                      help="default: the local Ray's CPUs / actors, or 1 on a cluster")
    ray_.add_argument("--gpus-per-actor", type=float, default=0.0,
                      help="GPUs each actor reserves in Ray; > 0 runs the model on that GPU (fractions "
                           "share one GPU between actors), 0 runs it on the CPU")
    ray_.add_argument("--threads-per-actor", type=int, default=None,
                      help="torch intra-op threads per actor; default: the actor's CPUs (at least 1). On a "
                           "CPU shared with other work, 1 (and more actors) can be much faster "
                           "(docs/pipeline.md)")
    ray_.add_argument("--batch-rows", type=int, default=None,
                      help="rows per actor task; default 2 x max-batch-size")
    ray_.add_argument("--no-stream", action="store_true",
                      help="decode each actor task to its end before the next starts (the engine's slots "
                           "empty as its rows finish) instead of keeping one engine session full across "
                           "tasks")
    ray_.add_argument("--max-replacements", type=int, default=None,
                      help="dead actors replaced before giving up; default 3 + 2 x actors")
    ray_.add_argument("--batch-timeout", type=float, default=3600.0,
                      help="seconds a replica with work in flight may return nothing before it is given up "
                           "as lost (killed, its rows redone elsewhere); 0: no limit")
    ray_.add_argument("--start-timeout", type=float, default=3600.0,
                      help="seconds a replica may take to be placed and load the model before it is given "
                           "up; 0: no limit")


def build_parser(prog: str = "jobs/generate.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION,
        formatter_class=DefaultsHelpFormatter)
    _add_io_arguments(p)
    ref = p.add_argument_group("reference corpora (shared n-gram indexes)")
    ref.add_argument("--reference", action="append", default=[], metavar="[NAME=]PATH[#COLUMN]",
                     help="text corpus (file, directory, table/dataset column), an index from "
                          "jobs/build_index.py, or a REST datastore directory from logitspec rest-build "
                          "(what --method rest retrieves from); repeatable, NAME matches --corpus-column "
                          "values")
    gen = p.add_argument_group("generation (as in the engine)")
    gen.add_argument("--model", default="default",
                     help="'default', a HF model dir, a .gguf file or a cached HF id")
    gen.add_argument("--method", default="logitspec", choices=METHODS, help=METHOD_HELP)
    gen.add_argument("--budget", default="auto", choices=("auto", "fixed"),
                     help="draft budget: auto (from this machine's cost curve and acceptance) or fixed "
                          "capacity")
    gen.add_argument("--history-tokens", type=int, default=0,
                     help="keep each replica's answers (up to this many tokens, oldest dropped) as a draft "
                          "source consulted after the row's own context and its reference; helps when "
                          "answers repeat each other (samples of one prompt, rows of one template). 0: off")
    gen.add_argument("--share-history", action="store_true",
                     help="one history for the whole job: each batch sent to a replica carries the answers "
                          "other replicas produced since its last batch (up to --history-tokens)")
    gen.add_argument("--chat", action="store_true",
                     help="apply the tokenizer's chat template to text prompts")
    gen.add_argument("--chat-template", metavar="FILE|STRING",
                     help="the Jinja chat template to apply (a file, or the template itself), for a "
                          "tokenizer without one or instead of its own (as vLLM's --chat-template)")
    gen.add_argument("--truncate", default="error", choices=TRUNCATE,
                     help="a prompt that leaves no room for --max-new-tokens in the model's context: error "
                          "(an error row when it does not fit at all), or cut to fit keeping its end (left) "
                          "or both ends (middle, as LongBench); the output's truncated column says which")
    gen.add_argument("--max-batch-size", type=int, default=4, help="sequences decoded together in one engine")
    gen.add_argument("--runner", default="auto", choices=RUNNERS,
                     help=RUNNER_HELP)
    gen.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 on GPU")
    gen.add_argument("--no-warmup", action="store_true", help="skip the replica's warm-up generation")
    gen.add_argument("--trust-remote-code", action="store_true",
                     help="let transformers run Python code shipped with the model (off: such models are "
                          "refused)")
    add_request_flags(p, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)  # the flags every command shares
    for action in p._actions:  # argparse keeps no public handle on them: say what two of them mean in a job
        action.help = JOB_MEANING.get(action.dest, action.help)
    _add_ray_arguments(p)
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    p.add_argument("--json", action="store_true",
                   help="end by printing the summary's rows, tokens, MAT and timing as JSON (default: a few "
                        "lines of text; the whole summary is in the output's _summary.json either way)")
    return p


# Request's field names in its messages -> the job's flags
FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
         "top_k": "--top-k", "n (samples per prompt)": "--num-samples", "stop strings": "--stop strings"}


def job_request(args: argparse.Namespace) -> Request:
    """The job's :class:`Request` from the shared decoding flags; :class:`ConfigError` naming the flag."""
    try:
        return request_from_args(args)
    except ValueError as e:
        message = str(e)
        for name, flag in FLAGS.items():
            message = message.replace(name, flag) if flag not in message else message
        raise ConfigError(message) from None


def config_from_args(args: argparse.Namespace) -> JobConfig:
    from logitspec.versions import UnsupportedVersion, check_versions

    try:  # before Ray starts (each replica's engine checks its own machine again)
        check_versions()
    except UnsupportedVersion as e:
        raise ConfigError(str(e)) from None
    engine = engine_config(method=args.method, budget=args.budget, max_batch_size=args.max_batch_size,
                           runner=args.runner)
    gen = GenerationSpec(model=args.model, engine=engine, request=job_request(args), chat=args.chat,
                         chat_template=read_chat_template(args.chat_template),
                         truncate=args.truncate,
                         dtype=args.dtype,
                         warmup=not args.no_warmup,
                         trust_remote_code=args.trust_remote_code, history_tokens=args.history_tokens,
                         share_history=args.share_history)
    return JobConfig(
        input=args.input, output=args.output, gen=gen, prompt_column=args.prompt_column,
        input_format=args.input_format, output_format=args.output_format, results=args.results,
        id_column=args.id_column,
        messages_column=args.messages_column, corpus_column=args.corpus_column, split=args.split,
        limit=args.limit,
        references=tuple(parse_reference(r) for r in args.reference),
        request_columns=tuple(c.strip() for c in args.request_columns.split(",") if c.strip()),
        keep_columns=args.keep_columns,
        actors=args.actors, tp=args.tp,
        cpus_per_actor=args.cpus_per_actor, gpus_per_actor=args.gpus_per_actor,
        threads_per_actor=args.threads_per_actor, batch_rows=args.batch_rows, stream=not args.no_stream,
        part_rows=args.part_rows, part_seconds=args.part_seconds, overwrite=args.overwrite,
        allow_foreign_files=args.allow_foreign_files,
        address=args.address, log_interval=args.log_interval, max_replacements=args.max_replacements,
        batch_timeout_s=args.batch_timeout or None, start_timeout_s=args.start_timeout or None)


def dry_run(cfg: JobConfig) -> int:
    """``--dry-run``: plan the job (no Ray, nothing written) and print the plan as JSON."""
    import time

    from .plan import dry_run_report, make_plan

    t0 = time.perf_counter()
    plan = make_plan(cfg, dry_run=True)
    print(json.dumps(dry_run_report(plan.cfg, plan, t0), indent=2))  # the config as planning resolved it
    return 0


def main(argv=None, prog: str = "jobs/generate.py") -> int:
    """``jobs/generate.py`` and ``logitspec job`` (``prog``: the name its help and errors give)."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    from ..replica.scheduler import JobFailed
    from .run import run_job

    def on_sigterm(signum, frame):  # before generation starts; while it runs, run_job handles signals
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)

    try:
        cfg = config_from_args(args)
        if args.dry_run:
            return dry_run(cfg)
        summary = run_job(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (JobFailed, OSError) as e:
        print(f"error: the job did not finish: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit) as e:
        print(f"interrupted ({e or type(e).__name__}); rerun the same command to resume", file=sys.stderr)
        return 130
    print(run_summary(summary, args.json))
    return 0 if summary["complete"] else 1


def run_summary(summary: dict, as_json: bool) -> str:
    """What the job prints at its end: a few lines for people, or (``--json``) the summary's first
    sections as JSON."""
    from ..io.output import SUMMARY_FILE
    from .summary import summary_text

    if not as_json:
        return summary_text(summary, f"{summary['output']['dir']}/{SUMMARY_FILE}")
    brief = {k: summary[k] for k in ("complete", "rows", "tokens", "rows_per_s", "mat")}
    brief["timing"] = {k: v for k, v in summary["timing"].items() if v is not None}
    return json.dumps(brief, indent=2)

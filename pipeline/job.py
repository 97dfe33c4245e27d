"""The batch-generation job: validate, start (or join) Ray, share the indexes, run replicas, summarize.

Order matters: everything that can be wrong with the flags, the input, the model or the references
is checked before Ray starts, so a bad job fails in seconds with a message naming the problem.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import pathlib
import platform
import signal
import threading
import time
from collections import defaultdict
from typing import Callable

from .config import ConfigError, JobConfig
from .inputs import InputRows, load_input, row_problem, row_prompt
from .output import OutputStore
from .worker import error_row

log = logging.getLogger("pipeline.job")

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- checks
def check_model(spec: str) -> pathlib.Path:
    """Local dir of the model (converting/caching it if needed); ConfigError if missing or unreadable."""
    from logitspec.models import ModelNotFoundError, resolve_model_path

    try:
        path = pathlib.Path(resolve_model_path(spec))
    except ModelNotFoundError as e:
        raise ConfigError(str(e)) from None
    except (OSError, RuntimeError, ValueError) as e:
        raise ConfigError(f"cannot prepare model {spec!r}: {type(e).__name__}: {e}") from None
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ConfigError(f"model {spec!r}: cannot read {path / 'config.json'}: {e}") from None
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    if not weights:
        raise ConfigError(f"model {spec!r}: no weights (*.safetensors, *.bin) in {path}")
    for w in weights:
        if w.suffix == ".safetensors":
            try:
                from safetensors import safe_open

                with safe_open(str(w), framework="pt") as fh:
                    fh.keys()
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"model {spec!r}: unreadable weights {w}: {e}") from None
    return path


def job_record(cfg: JobConfig) -> dict:
    """Settings that decide a row's output; a resumed run must use the same ones."""
    g = cfg.gen
    return {"model": g.model, "method": g.method, "max_new_tokens": g.max_new_tokens,
            "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k, "seed": g.seed,
            "stop": list(g.stop), "chat": g.chat, "dtype": g.dtype,
            "id_column": cfg.id_column, "prompt_column": cfg.prompt_column,
            "messages_column": cfg.messages_column, "corpus_column": cfg.corpus_column,
            "references": {n: p for n, p in cfg.references}}


def _corpus_of_rows(cfg: JobConfig, data: InputRows) -> list:
    """Each row's corpus name (selects its reference index); checks the names against --reference."""
    names = [n for n, _ in cfg.references]
    if data.corpora is None:
        return [names[0] if names else None] * len(data)
    used = {c for c in data.corpora if c is not None}
    unused = [n for n in names if n not in used]
    if unused:
        raise ConfigError(f"--reference {unused[0]!r} names no corpus in column {cfg.corpus_column!r} "
                          f"(values: {', '.join(sorted(map(str, used))[:10]) or 'none'})")
    missing = sorted(used - set(names))
    if names and missing:
        log.warning("rows of corpus %s have no --reference; they draft from their own context only",
                    ", ".join(missing[:10]))
    return list(data.corpora)


# ---------------------------------------------------------------------------------------------- progress
class Progress:
    """Counts rows and tokens of this run; logs rows done / total, tokens/s and running MAT."""

    def __init__(self, total: int, skipped: int, todo: int, interval: float):
        self.total, self.skipped, self.todo = total, skipped, todo
        self.done = self.failed = self.tokens = self.steps = 0
        self.by_replicas = 0  # rows that went through a replica (not rejected before generation)
        self.per_corpus: dict = defaultdict(lambda: {"rows": 0, "failed": 0, "tokens": 0, "steps": 0})
        self.interval = interval
        self.t_start = time.perf_counter()
        self.t_gen: float | None = None  # first batch sent
        self._last_log = 0.0

    def add(self, rows: list[dict]) -> None:
        for r in rows:
            c = self.per_corpus[r.get("corpus") or "(none)"]
            c["rows"] += 1
            if r["error"] is not None:
                self.failed += 1
                c["failed"] += 1
            else:
                self.done += 1
                self.tokens += r["n_new_tokens"]
                self.steps += r["steps"]
                c["tokens"] += r["n_new_tokens"]
                c["steps"] += r["steps"]

    @property
    def mat(self) -> float | None:
        return self.tokens / self.steps if self.steps else None

    def line(self) -> str:
        now = time.perf_counter()
        gen = now - self.t_gen if self.t_gen else 0.0
        finished = self.done + self.failed
        tps = self.tokens / gen if gen > 0 else 0.0
        eta = (self.todo - finished) * gen / finished if finished and gen > 0 else float("nan")
        mat = f"{self.mat:.2f}" if self.mat else "-"
        return (f"rows {self.skipped + finished}/{self.total} (this run {finished}/{self.todo}, "
                f"{self.failed} failed, {self.skipped} already done) | {tps:.1f} tok/s | MAT {mat} | "
                f"generating {gen:.0f} s" + (f", eta {eta:.0f} s" if math.isfinite(eta) else ""))

    def tick(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last_log >= self.interval:
            self._last_log = now
            log.info("%s", self.line())


# ---------------------------------------------------------------------------------------------- Ray
def connect_ray(cfg: JobConfig) -> dict:
    """Join ``--address`` / ``$RAY_ADDRESS`` (set under ``ray job submit``), else start a local Ray."""
    import ray

    if ray.is_initialized():
        return {"started_here": False, "reused_session": True}
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"cannot join the Ray cluster at {address!r}: {e}") from None
        return {"started_here": False, "address": address}
    # Local Ray: its workers inherit this environment; make this checkout importable in them even
    # when the project is not pip-installed.
    paths = [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # Ray runs workers at nice 15 by default, below every other process of a shared machine, though
    # the actors do all of this job's work. A local Ray is ours: nice 0 (unless set by the user).
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
    return {"started_here": True, "address": "local"}


def replica_resources(cfg: JobConfig, started_here: bool):
    import ray

    from .replica import ReplicaResources

    total = ray.cluster_resources()
    cpus = cfg.cpus_per_actor
    if cpus is None:
        # a local Ray is ours: share its CPUs among the actors; on a cluster one CPU per actor
        cpus = max(total.get("CPU", 1.0) / (cfg.actors * cfg.tp), 0.01) if started_here else 1.0
        cpus = math.floor(cpus * 100) / 100
    threads = cfg.threads_per_actor or 1
    if cfg.gpus_per_actor > total.get("GPU", 0.0):
        raise ConfigError(f"--gpus-per-actor {cfg.gpus_per_actor} but the Ray cluster has "
                          f"{total.get('GPU', 0.0):g} GPU(s)")
    if cpus > total.get("CPU", 0.0):
        raise ConfigError(f"--cpus-per-actor {cpus} but the Ray cluster has {total.get('CPU', 0.0):g} CPU(s)")
    if cfg.tp > 1:  # every replica's N shards must fit on one node
        from .tp import check_fits

        check_fits(cfg.actors, cfg.tp, cpus, cfg.gpus_per_actor)
    return ReplicaResources(num_cpus=cpus, num_gpus=cfg.gpus_per_actor, threads=threads)


@contextlib.contextmanager
def stop_on_signals(sched):
    """SIGINT/SIGTERM ask the scheduler to stop after its current (1 s) wait, so the job kills its
    actors and writes a summary. Raising from the handler instead can leave the driver stuck inside
    ``ray.wait`` (seen with Ray 2.60 on Ctrl-C). A second signal exits at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if sched.stop_requested:
            os._exit(128 + signum)
        sched.stop_requested = f"stopped by {signal.Signals(signum).name}"
        log.warning("%s: stopping after the current wait (again to exit at once); rerun to resume",
                    signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------------------------- the job
def run_job(cfg: JobConfig, on_event: Callable[..., None] | None = None) -> dict:
    """Run the whole job; returns the summary (also written to ``<output>/summary.json``).

    Raises :class:`ConfigError` before Ray starts if the job cannot run, and
    :class:`pipeline.scheduler.JobFailed` (after writing a summary) if it cannot finish.
    """
    t0 = time.perf_counter()
    timing: dict = {}
    # ---- 1. validate: input, model, references, output dir (no Ray yet)
    data = load_input(cfg)
    corpora = _corpus_of_rows(cfg, data)
    model_path = check_model(cfg.gen.model)
    timing["validate_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    references = {}
    if cfg.references:
        from transformers import AutoTokenizer

        from .reference import prepare_reference

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--reference needs the model's tokenizer; cannot load it from {model_path}: {e}") from None
        for name, spec in cfg.references:
            references[name] = prepare_reference(name, spec, tokenizer, cfg.gen.spec_config().max_ngram)
            m = references[name]["__meta__"]
            log.info("reference %r: %s", name, bytes(m).decode()[:300])
    timing["reference_build_s"] = time.perf_counter() - t

    store = OutputStore(cfg.output, data.id_type)
    existing = store.prepare(job_record(cfg), cfg.overwrite)
    done_ids = store.written
    stale = len(done_ids - set(data.ids)) if done_ids else 0
    if stale:
        log.warning("%d row(s) in %s are not in the input", stale, cfg.output)

    # ---- 2. rows to do; rows that cannot be generated become error rows now
    use_messages = cfg.messages_column is not None
    todo: list[dict] = []
    bad: list[dict] = []
    skipped = 0
    for i, rid in enumerate(data.ids):
        if rid in done_ids:
            skipped += 1
            continue
        prompt = data.prompts[i] if data.prompts is not None else None
        messages = data.messages[i] if data.messages is not None else None
        problem = row_problem(prompt, messages, use_messages)
        if problem:
            bad.append(error_row(rid, problem, cfg.gen, corpora[i]))
        else:
            todo.append({"id": rid, "prompt": row_prompt(prompt, messages, use_messages), "corpus": corpora[i]})
    progress = Progress(len(data), skipped, len(todo) + len(bad), cfg.log_interval)
    if bad:
        store.write(bad)
        progress.add(bad)
    log.info("input %s: %d rows, %d already in %s, %d to generate, %d rejected before generation",
             data.source, len(data), skipped, cfg.output, len(todo), len(bad))

    sched_stats = None
    failure: BaseException | None = None
    ray_info = None
    replicas_at_end: list = []
    sched = None
    try:
        if todo:
            # ---- 3. Ray, shared indexes, replicas
            import ray

            from .replica import make_replica_factory
            from .scheduler import Batch, Scheduler

            t = time.perf_counter()
            ray_info = connect_ray(cfg)
            timing["ray_init_s"] = time.perf_counter() - t
            resources = replica_resources(cfg, ray_info["started_here"])
            t = time.perf_counter()
            refs = {name: ray.put(arrays) for name, arrays in references.items()}  # once per corpus
            timing["reference_put_s"] = time.perf_counter() - t
            factory = make_replica_factory(cfg.gen, resources, refs, tp=cfg.tp)
            size = cfg.rows_per_batch
            batches = [Batch(k, todo[s:s + size]) for k, s in enumerate(range(0, len(todo), size))]
            made: list = []

            def tracking_factory(name):
                rep = factory(name)
                made.append(rep)
                return rep

            def on_result(batch, rows, stats):
                store.write(rows)
                progress.add(rows)
                progress.by_replicas += len(rows)
                if progress.t_gen is None:
                    progress.t_gen = sched.stats.first_dispatch

            def on_failed(rows, reason):
                errs = [error_row(r["id"], reason, cfg.gen, r.get("corpus")) for r in rows]
                store.write(errs)
                progress.add(errs)
                progress.by_replicas += len(errs)

            def tick():
                if progress.t_gen is None and sched.stats.first_dispatch is not None:
                    progress.t_gen = sched.stats.first_dispatch
                progress.tick()

            log.info("starting %d replica(s): %s CPU, %s GPU, %d thread(s) each; %d batches of <= %d rows",
                     cfg.actors, resources.num_cpus, resources.num_gpus, resources.threads, len(batches), size)
            sched = Scheduler(tracking_factory, cfg.actors, batches, on_result, on_failed, on_event=on_event,
                              on_tick=tick, max_replacements=cfg.replacements,
                              max_row_attempts=cfg.max_row_attempts)
            t_sched = time.perf_counter()
            try:
                with stop_on_signals(sched):
                    sched_stats = sched.run()
                # final memory of the live replicas (one model copy each, indexes shared)
                alive = [s for s in sched.slots.values() if s.ready]
                infos = ray.get([s.replica.info() for s in alive], timeout=60) if alive else []
                replicas_at_end = [{**i, "name": s.info["name"]} for s, i in zip(alive, infos)]
            finally:
                for rep in made:
                    rep.kill()
                # also when stopped or failed: the summary says how far start-up and generation got
                timing["replicas_first_ready_s"] = sched.stats.first_ready_s
                timing["replicas_all_ready_s"] = sched.stats.all_ready_s
                if sched.stats.first_dispatch is not None:
                    timing["startup_s"] = sched.stats.first_dispatch - t0
                    end = sched.stats.last_result or time.perf_counter()
                    timing["generation_s"] = end - sched.stats.first_dispatch
                timing["scheduler_s"] = time.perf_counter() - t_sched
    except BaseException as e:  # noqa: BLE001 - summarize, then re-raise
        failure = e
        sched_stats = sched.stats if sched is not None else None
    finally:
        timing["total_s"] = time.perf_counter() - t0
        progress.tick(force=True)
        summary = _summary(cfg, data, store, progress, timing, references, sched_stats, replicas_at_end,
                           ray_info, model_path, failure)
        store.write_summary(summary)
        if ray_info and ray_info.get("started_here"):
            import ray

            ray.shutdown()
    if failure is not None:
        raise failure
    return summary


def _summary(cfg, data, store, progress: Progress, timing, references, sched_stats, replicas_at_end,
             ray_info, model_path, failure) -> dict:
    import pyarrow.compute as pc

    out = store.read_existing()
    in_output = out.num_rows if out is not None else 0
    input_ids = set(data.ids)
    out_ids = out.column("id").to_pylist() if out is not None else []
    covered = sum(1 for i in set(out_ids) if i in input_ids)
    duplicates = len(out_ids) - len(set(out_ids))
    per_corpus_out: dict = {}
    tokens_out = steps_out = failed_out = 0
    if out is not None:
        ok = out.filter(pc.is_null(out.column("error")))
        failed_out = out.num_rows - ok.num_rows
        tokens_out = int(pc.sum(ok.column("n_new_tokens")).as_py() or 0)
        steps_out = int(pc.sum(ok.column("steps")).as_py() or 0)
        for c, n, s in zip(ok.column("corpus").to_pylist(), ok.column("n_new_tokens").to_pylist(),
                           ok.column("steps").to_pylist()):
            d = per_corpus_out.setdefault(c or "(none)", {"rows": 0, "tokens": 0, "steps": 0})
            d["rows"] += 1
            d["tokens"] += n
            d["steps"] += s
    gen_s = timing.get("generation_s")
    ref_meta = {}
    for name, arrays in references.items():
        import json

        meta = json.loads(bytes(arrays["__meta__"]).decode())
        ref_meta[name] = {k: meta.get(k) for k in ("source", "documents", "tokens", "bytes", "build_s", "prebuilt")}
    nodes = sorted({r.get("node_id") for r in replicas_at_end if r.get("node_id")})
    infos = sched_stats.replica_info if sched_stats else []
    summary = {
        "complete": covered == len(input_ids) and failure is None,
        "rows": {
            "total": len(data), "done_now": progress.done, "failed_now": progress.failed,
            "skipped_already_done": progress.skipped, "in_output": in_output,
            "failed_in_output": failed_out, "not_in_input": in_output - covered - duplicates,
            "duplicates_in_output": duplicates, "missing": len(input_ids) - covered,
        },
        "tokens": {
            "new_now": progress.tokens,
            "per_s": progress.tokens / gen_s if gen_s else None,
            "in_output": tokens_out,
        },
        "rows_per_s": progress.by_replicas / gen_s if gen_s else None,
        "mat": {
            "now": progress.mat,
            "output": tokens_out / steps_out if steps_out else None,
            "per_corpus_now": {k: {**v, "mat": v["tokens"] / v["steps"] if v["steps"] else None,
                                   "reference": k in references} for k, v in sorted(progress.per_corpus.items())},
            "per_corpus_output": {k: {**v, "mat": v["tokens"] / v["steps"] if v["steps"] else None,
                                      "reference": k in references} for k, v in sorted(per_corpus_out.items())},
        },
        "timing": timing,
        "replicas": {
            "requested": cfg.actors,
            "started": sched_stats.replicas_started if sched_stats else 0,
            "deaths": sched_stats.deaths if sched_stats else 0,
            "replacements": sched_stats.replacements if sched_stats else 0,
            "batches_redone": sched_stats.batches_redone if sched_stats else 0,
            "startup": [{k: i.get(k) for k in ("name", "pid", "device", "dtype", "threads", "ready_s", "import_s",
                                               "model_load_s", "reference_attach_s", "warmup_s")} for i in infos],
        },
        "memory": {
            "model_bytes_per_replica": infos[0]["model_bytes"] if infos else None,
            "model_copies": len(replicas_at_end),  # one per live replica (actor) at the end
            "replicas": [{"name": r["name"], "pid": r["pid"], "node_id": r["node_id"],
                          "rss_bytes": r["memory"].get("VmRSS"), "rss_anon_bytes": r["memory"].get("RssAnon"),
                          "rss_shmem_bytes": r["memory"].get("RssShmem"),
                          "reference_zero_copy": r.get("reference_zero_copy")} for r in replicas_at_end],
            "reference_indexes": ref_meta,
            # each index was put in the object store once; a node holds one copy, which its actors map
            "reference_copies_per_node": 1 if references else 0,
            "nodes_with_replicas": len(nodes),
            "reference_zero_copy": (all(r.get("reference_zero_copy") for r in replicas_at_end)
                                    if references and replicas_at_end else None),
        },
        "model_path": str(model_path),
        "ray": ray_info,
        "output": {"dir": str(store.root), "part_files": len(store.part_files()),
                   "parts_written_now": store.parts_written},
        "config": cfg.as_dict(),
        "error": None if failure is None else f"{type(failure).__name__}: {failure}",
        "host": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return summary

"""``logitspec bench``: Spec-Bench tables for our methods and the baselines users would pick instead.

Every method runs in one process on the same prompts: after a warm-up (one call per method), each
unit (a question-turn at batch size 1; up to ``max_batch_size`` questions of one task otherwise) is
run by all methods back to back, in an order rotated per unit, so machine noise hits them alike.
Records, summary, report and plots go to one directory (see :func:`run_bench`); the numbers are
computed by :mod:`logitspec.bench_report` from the records alone.

Methods: the engine's (``ar``, ``pld``, ``logitspec``, any later one in :data:`config.METHODS`),
``hf`` (``model.generate(do_sample=False)``) and ``hf-pld`` (``prompt_lookup_num_tokens=10``).
A variant overrides fields: ``logitspec@capacity=8@top_k=8`` (SpecConfig fields) or
``hf-pld@prompt_lookup_num_tokens=4`` (``generate`` keywords). ``ar`` is the reference and always runs.

MT-bench's second turn: the prompt is the conversation with ``ar``'s first-turn answer, for every
method, so all methods see the same second-turn prompt.
"""
from __future__ import annotations

import ast
import datetime
import json
import os
import pathlib
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence

from . import bench_report
from .bench_report import TASKS

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
REFERENCE = "ar"
HF_METHODS = ("hf", "hf-pld")
DEFAULT_METHODS = "ar,pld,logitspec,hf,hf-pld"
QUICK = {"per_task": 1, "max_new_tokens": 16, "methods": "ar,logitspec,hf"}
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_QUESTIONS = REPO_ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"


# --------------------------------------------------------------------------------------- questions
@dataclass(frozen=True)
class Question:
    """One Spec-Bench row; ``turns`` are texts, or token-id lists for a model without a tokenizer."""

    question_id: Any
    category: str
    turns: tuple

    @property
    def task(self) -> str:
        return "mt_bench" if self.category in MT_BENCH_CATEGORIES else self.category


def load_questions(path=None, per_task: int | None = None, categories: Sequence[str] | None = None) -> list[Question]:
    """Rows of a Spec-Bench ``question.jsonl``, in file order, grouped by task (Spec-Bench's order).

    ``categories`` keeps rows whose category or task is listed; ``per_task`` then keeps the first N
    rows of each task.
    """
    path = pathlib.Path(path) if path is not None else DEFAULT_QUESTIONS
    if not path.is_file():
        raise ValueError(f"questions file not found: {path} (Spec-Bench's question.jsonl; the default is "
                         f"../shared/data/spec_bench/question.jsonl beside the repository; pass --questions)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                turns = tuple(t if isinstance(t, str) else tuple(int(x) for x in t) for t in d["turns"])
                rows.append(Question(d["question_id"], str(d["category"]), turns))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: not a Spec-Bench row ({e})") from None
            if not rows[-1].turns:
                raise ValueError(f"{path}:{n}: no turns")
    return select_questions(rows, per_task, categories)


def select_questions(rows: Sequence[Question], per_task: int | None = None,
                     categories: Sequence[str] | None = None) -> list[Question]:
    if categories:
        wanted = set(categories)
        known = {q.category for q in rows} | {q.task for q in rows}
        if wanted - known:
            raise ValueError(f"unknown categories {sorted(wanted - known)}; known: {sorted(known)}")
        rows = [q for q in rows if q.category in wanted or q.task in wanted]
    if per_task is not None and per_task < 1:
        raise ValueError(f"per_task must be >= 1, got {per_task}")
    order = [t for t in TASKS if any(q.task == t for q in rows)]
    order += sorted({q.task for q in rows} - set(order))
    out = []
    for t in order:
        out += [q for q in rows if q.task == t][:per_task]
    if not out:
        raise ValueError("no questions selected")
    return out


# ----------------------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class MethodSpec:
    """A named method: ``base`` (an engine method or an HF baseline) plus field overrides."""

    name: str
    base: str
    overrides: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def is_hf(self) -> bool:
        return self.base in HF_METHODS


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside brackets, so ``rank_limits=(8,32)`` survives a comma split."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_methods(text: str | Sequence[str]) -> list[MethodSpec]:
    """``"ar,pld,logitspec@capacity=8,hf-pld@prompt_lookup_num_tokens=4"`` -> specs; ``ar`` added first
    if missing (it is the reference)."""
    from .config import METHODS, SpecConfig

    items = _split_top(text, ",") if isinstance(text, str) else list(text)
    spec_fields = {f.name for f in fields(SpecConfig)} - {"method", "extra"}
    specs: list[MethodSpec] = []
    for item in items:
        base, *kvs = _split_top(item, "@")
        if base not in METHODS and base not in HF_METHODS:
            raise ValueError(f"unknown method {base!r}; choose from {', '.join(METHODS + HF_METHODS)}")
        overrides = {}
        for kv in kvs:
            key, eq, val = kv.partition("=")
            if not eq:
                raise ValueError(f"method variant {item!r}: expected key=value after '@', got {kv!r}")
            key = key.strip()
            if base not in HF_METHODS and key not in spec_fields:
                raise ValueError(f"method variant {item!r}: {key!r} is not a SpecConfig field")
            overrides[key] = _value(val.strip())
        if any(s.name == item for s in specs):
            raise ValueError(f"method {item!r} listed twice")
        specs.append(MethodSpec(item, base, overrides))
    if not any(s.name == REFERENCE for s in specs):
        specs.insert(0, MethodSpec(REFERENCE, REFERENCE))
    return specs


# ----------------------------------------------------------------------------------------- runners
def _sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


class EngineRunner:
    """One of our engine's methods; one ``generate`` call per unit."""

    def __init__(self, model, tokenizer, config):
        from .engine import Engine

        self.engine = Engine(model, tokenizer, config)

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, list[dict]]:
        dev = self.engine.device
        _sync(dev)
        t0 = time.perf_counter()
        results = self.engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)
        _sync(dev)
        wall = time.perf_counter() - t0
        outs = []
        for r in results:
            st = r.stats
            outs.append({
                "token_ids": list(r.token_ids), "text": r.text, "finish_reason": r.finish_reason,
                "steps": st["steps"], "decode_steps": max(st["steps"] - 1, 0),
                "accept_lengths": list(st["accepted_lengths"]),
                "retrieval_success": st["retrieval_success"], "mean_tree_size": st["mean_tree_size"],
                **{p: st[p] for p in bench_report.TIME_PARTS}, "engine_wall_s": st["wall_s"],
            })
        return wall, outs


class HFRunner:
    """``model.generate`` greedy (optionally with prompt lookup), one prompt at a time.

    Forwards are counted with a public forward pre-hook; per-forward accepted lengths are read from
    the ``position_ids`` each forward receives (the sequence length after forward i is the next
    forward's first position + 1), and left out when a forward does not receive them.
    """

    def __init__(self, model, tokenizer, eos_ids: set[int], overrides: dict, base: str):
        self.model = model
        self.tokenizer = tokenizer
        self.kwargs = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if base == "hf-pld":
            self.kwargs["prompt_lookup_num_tokens"] = 10
        self.kwargs.update(overrides)
        eos = sorted(eos_ids)
        # the same stopping tokens as the engine, so that outputs are comparable
        self.kwargs["eos_token_id"] = eos or None
        self.kwargs["pad_token_id"] = eos[0] if eos else 0
        self.eos = set(eos)

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, list[dict]]:
        import torch

        dev = next(self.model.parameters()).device
        outs, total = [], 0.0
        for ids in prompts:
            starts: list = []  # first position of each forward (a 1-element tensor: no device sync here)

            def hook(module, args, kwargs):
                pos = kwargs.get("position_ids")
                starts.append(pos.reshape(-1)[:1].clone() if pos is not None else None)

            x = torch.tensor([ids], device=dev)
            handle = self.model.register_forward_pre_hook(hook, with_kwargs=True)
            try:
                _sync(dev)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                              **self.kwargs)
                _sync(dev)
                wall = time.perf_counter() - t0
            finally:
                handle.remove()
            new = out[0, len(ids):].tolist()
            starts = [int(p) if p is not None else None for p in starts]
            total += wall
            outs.append({
                "token_ids": new,
                "text": self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer is not None else None,
                "finish_reason": "stop" if new and new[-1] in self.eos else "length",
                "steps": len(starts), "decode_steps": max(len(starts) - 1, 0),
                "accept_lengths": _accept_lengths(starts, len(ids), len(new)),
                "wall_time": wall,
            })
        return total, outs


def _accept_lengths(starts: list[int | None], prompt_len: int, new_tokens: int) -> list[int] | None:
    """Tokens emitted by each forward, from each forward's first position (None if unknown)."""
    if not starts or any(s is None for s in starts):
        return None
    lengths = [s + 1 for s in starts[1:]] + [prompt_len + new_tokens]
    emitted = [b - a for a, b in zip([prompt_len] + lengths[:-1], lengths)]
    return emitted if all(e >= 0 for e in emitted) and sum(emitted) == new_tokens else None


# ----------------------------------------------------------------------------------------- prompts
class PromptBuilder:
    """Token ids of a turn: the chat template when the tokenizer has one, else the raw text; turn i > 0
    sees the previous turns and the reference's answers to them."""

    def __init__(self, tokenizer, encode: Callable):
        self.tokenizer = tokenizer
        self.encode = encode
        self.chat = bool(tokenizer is not None and getattr(tokenizer, "chat_template", None))

    def __call__(self, q: Question, turn: int, answers: Sequence) -> list[int]:
        turns = q.turns[: turn + 1]
        if all(not isinstance(t, str) for t in turns):  # pre-tokenized: concatenate ids
            ids: list[int] = []
            for i, t in enumerate(turns):
                ids += list(t) + (list(answers[i]) if i < turn else [])
            return self.encode(ids)
        if any(not isinstance(t, str) for t in turns):
            raise ValueError(f"question {q.question_id}: mixes text and token-id turns")
        texts = [self.tokenizer.decode(a, skip_special_tokens=True) for a in answers[:turn]]
        if self.chat:
            msgs = []
            for i, t in enumerate(turns):
                msgs.append({"role": "user", "content": t})
                if i < turn:
                    msgs.append({"role": "assistant", "content": texts[i]})
            return self.encode(msgs, apply_chat_template=True)
        parts = []
        for i, t in enumerate(turns):
            parts += [t] + ([texts[i]] if i < turn else [])
        return self.encode("\n\n".join(parts))


# ------------------------------------------------------------------------------------------- run
def machine_info(model=None) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if model is not None:
        p = next(model.parameters())
        info["device"] = str(p.device)
        info["dtype"] = str(p.dtype).replace("torch.", "")
        if p.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(p.device)
    return info


def code_version() -> str | None:
    """``logitspec <version>, git <commit>[ + uncommitted changes]`` of the code that ran."""
    import subprocess

    try:
        from importlib.metadata import version

        text = f"logitspec {version('logitspec')}"
    except Exception:  # noqa: BLE001 - not installed: the git commit still says what ran
        text = "logitspec"
    try:
        git = ["git", "-C", str(REPO_ROOT)]
        commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--", "logitspec"],
                               capture_output=True, text=True, timeout=10, check=True).stdout
        changed = [line[3:] for line in dirty.splitlines() if line.strip()]  # "XY path"
        text += f", git {commit}" + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return text


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _units(questions: Sequence[Question], batch: int) -> list[list[Question]]:
    """Groups of up to ``batch`` questions of one task, in order."""
    groups: list[list[Question]] = []
    for q in questions:
        if groups and len(groups[-1]) < batch and groups[-1][0].task == q.task:
            groups[-1].append(q)
        else:
            groups.append([q])
    return groups


def run_bench(model, tokenizer, questions: Sequence[Question], out_dir, methods: str | Sequence[str] = DEFAULT_METHODS,
              max_new_tokens: int = 64, max_batch_size: int = 1, capacity: int | None = None,
              top_k: int | None = None, warmup: bool = True, warmup_tokens: int = 16, progress: bool = True,
              model_name: str = "?", command: str | None = None, settings: dict | None = None,
              resume: bool = False) -> dict:
    """Run every method on every question-turn, write ``results.jsonl``, ``summary.json``, ``report.md``
    and PNG plots into ``out_dir``, and return the summary.

    ``questions`` may hold token-id turns (then ``tokenizer`` may be None). ``capacity`` / ``top_k`` set
    those SpecConfig fields for every engine method (a variant's own ``@field=`` wins). ``resume``
    keeps the complete units already in ``out_dir/results.jsonl`` (same settings required) and runs
    the rest, in the same rotation.
    """
    from .config import SpecConfig

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    specs = parse_methods(methods)
    base_cfg = {"max_batch_size": max_batch_size}
    if capacity is not None:
        base_cfg["capacity"] = capacity
    if top_k is not None:
        base_cfg["top_k"] = top_k
    runners: dict[str, Any] = {}
    for s in specs:  # build every config first: a bad variant fails before any forward
        if not s.is_hf:
            runners[s.name] = EngineRunner(model, tokenizer, SpecConfig(method=s.base, **{**base_cfg, **s.overrides}))
    ref = runners[REFERENCE].engine
    for s in specs:
        if s.is_hf:
            runners[s.name] = HFRunner(model, tokenizer, ref.eos_ids, s.overrides, s.base)
    names = [s.name for s in specs]
    build = PromptBuilder(tokenizer, ref.encode)

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _units(list(questions), max_batch_size)
    n_turns = sum(len(q.turns) for q in questions)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    code = code_version()  # now: the modules were imported from this tree, whatever changes later
    load_start = _load()
    summary = {
        "model": {"name": model_name, "class": type(model).__name__,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "machine": machine_info(model),
        "command": command,
        "code": code,
        "settings": {"methods": names, "max_new_tokens": max_new_tokens, "max_batch_size": max_batch_size,
                     "capacity": capacity, "top_k": top_k, "warmup": warmup, "warmup_tokens": warmup_tokens,
                     "temperature": 0.0, "chat_template": build.chat, **(settings or {})},
        "reference": REFERENCE,
        "questions": len(questions),
        "tasks": [t for t in TASKS if any(q.task == t for q in questions)]
        + sorted({q.task for q in questions} - set(TASKS)),
        "question_turns_per_task": _count_turns(questions),
        "started": started,
        "finished": None,  # null in the file while the run is going (or if it died): see rerender()
        "load_average": {"start": load_start, "end": None},
        "warmup_wall_s": None,
        "methods": {},
    }
    kept = _resumable(out, summary, names) if resume else {}
    if kept:
        summary["resumed"] = {"at": started, "kept_question_turns": len(kept)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    bar = _progress(total=len(names) * (n_turns + (1 if warmup else 0)), enabled=progress)

    warm = {}
    if warmup:
        prompts = [build(q, 0, []) for q in groups[0]]
        for name in names:
            bar.set_postfix_str(f"warm-up {name}", refresh=False)
            warm[name] = runners[name].run(prompts, min(warmup_tokens, max_new_tokens))[0]
            bar.update(1)

    records: list[dict] = []
    unit = 0
    with open(out / "results.jsonl", "w", encoding="utf-8") as f:
        for group in groups:
            answers: dict[Any, list] = {q.question_id: [] for q in group}
            for turn in range(max(len(q.turns) for q in group)):
                qs = [q for q in group if turn < len(q.turns)]
                old = [kept.get((q.question_id, turn)) for q in qs]
                if all(old):  # done before: keep its records (and the reference's answers)
                    for q, rs in zip(qs, old):
                        answers[q.question_id].append(rs[REFERENCE]["token_ids"])
                    for name in names:
                        for rs in old:
                            f.write(json.dumps(rs[name]) + "\n")
                            records.append(rs[name])
                    f.flush()
                    bar.update(len(qs) * len(names))
                    unit += 1
                    continue
                prompts = [build(q, turn, answers[q.question_id]) for q in qs]
                order = names[unit % len(names):] + names[: unit % len(names)]
                unit_records = {}
                for pos, name in enumerate(order):
                    bar.set_postfix_str(f"{qs[0].task} q{qs[0].question_id} t{turn + 1} {name}", refresh=False)
                    wall, outs = runners[name].run(prompts, max_new_tokens)
                    unit_records[name] = [
                        _record(name, q, turn, unit, pos, p, o, wall, len(qs)) for q, p, o in zip(qs, prompts, outs)]
                    bar.update(len(qs))
                for q, o in zip(qs, unit_records[REFERENCE]):
                    answers[q.question_id].append(o["token_ids"])
                for name in names:  # written in method order, whatever order they ran in
                    for r, a in zip(unit_records[name], unit_records[REFERENCE]):
                        r["same_as_ar"] = r["token_ids"] == a["token_ids"]
                        f.write(json.dumps(r) + "\n")
                        records.append(r)
                f.flush()
                unit += 1
    bar.close()

    summary["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    summary["load_average"]["end"] = _load()
    summary["warmup_wall_s"] = warm
    summary["methods"] = bench_report.summarize(records, REFERENCE, names)
    summary["method_configs"] = {name: _describe(r) for name, r in runners.items()}
    write_outputs(summary, out)
    return summary


def _describe(runner) -> dict:
    """What a method ran with: the full SpecConfig (defaults change) and, for the auto budget, the
    forward cost curve it used; or the ``generate`` keywords."""
    if isinstance(runner, HFRunner):
        return {"generate": {k: v for k, v in runner.kwargs.items() if v is not None}}
    import dataclasses

    eng = runner.engine
    cfg = {k: v for k, v in dataclasses.asdict(eng.config).items() if k != "extra"}
    out = {"config": cfg}
    curve = getattr(eng, "cost_curve", None)
    if curve is not None and hasattr(curve, "to_dict"):
        out["cost_curve"] = curve.to_dict()
    return out


def _resumable(out: pathlib.Path, summary: dict, names: list[str]) -> dict:
    """``{(question_id, turn): {method: record}}`` of the complete question-turns in ``out``'s results."""
    path = out / "results.jsonl"
    if not path.is_file():
        return {}
    meta = out / "summary.json"
    if meta.is_file():
        old = json.loads(meta.read_text(encoding="utf-8")).get("settings", {})
        for key in ("methods", "max_new_tokens", "max_batch_size", "capacity", "top_k"):
            if key in old and old[key] != summary["settings"][key]:
                raise ValueError(f"cannot resume {out}: its {key} was {old[key]!r}, now {summary['settings'][key]!r}")
    by_key: dict = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line cut short when the run died
        by_key.setdefault((r["question_id"], r.get("turn", 0)), {})[r["method"]] = r
    return {k: v for k, v in by_key.items() if set(v) >= set(names)}


def _count_turns(questions: Sequence[Question]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for q in questions:
        counts[q.task] = counts.get(q.task, 0) + len(q.turns)
    return counts


def _record(name, q: Question, turn, unit, pos, prompt, o: dict, wall, n) -> dict:
    r = {"method": name, "question_id": q.question_id, "category": q.category, "task": q.task, "turn": turn,
         "unit": unit, "order": pos, "prompt_tokens": len(prompt), "new_tokens": len(o["token_ids"]),
         "wall_time": o.get("wall_time", wall), "unit_wall_time": wall if n > 1 else None, "batch": n}
    r.update({k: v for k, v in o.items() if k != "wall_time"})
    r["tokens_per_s"] = r["new_tokens"] / r["wall_time"] if r["wall_time"] > 0 else None
    return r


def write_outputs(summary: dict, out_dir) -> None:
    """Plots, ``summary.json`` and ``report.md`` from a summary (re-runnable on an old summary)."""
    out = pathlib.Path(out_dir)
    summary["plots"] = ["speedup.png", "accept_hist.png"]
    bench_report.plot_speedup(summary, out / "speedup.png")
    bench_report.plot_accept_hist(summary, out / "accept_hist.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(bench_report.render_report(summary), encoding="utf-8")


def rerender(out_dir) -> dict:
    """Recompute the summary, report and plots of ``out_dir`` from its ``results.jsonl`` (e.g. after a
    change to the report, or while a run is going or after it died: units are written whole, so the
    records always hold complete units). Metadata come from its ``summary.json`` when there is one."""
    out = pathlib.Path(out_dir)
    path = out / "results.jsonl"
    if not path.is_file():
        raise ValueError(f"no results.jsonl in {out}")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no records yet")
    meta = out / "summary.json"
    summary = json.loads(meta.read_text(encoding="utf-8")) if meta.is_file() else {"reference": REFERENCE}
    ref = summary.get("reference", REFERENCE)
    names = (summary.get("settings") or {}).get("methods") or list(dict.fromkeys(r["method"] for r in records))
    done = [r for r in records if r["method"] == ref]
    counts: dict[str, int] = {}
    for r in done:
        counts[r["task"]] = counts.get(r["task"], 0) + 1
    expected = summary.get("question_turns_per_task")
    if summary.get("finished") is None or (expected and expected != counts):
        summary["partial"] = (f"{len(done)} of {sum(expected.values()) if expected else '?'} question-turns "
                              f"done (re-rendered from results.jsonl)")
    summary["question_turns_per_task"] = counts
    summary["tasks"] = [t for t in TASKS if t in counts] + sorted(set(counts) - set(TASKS))
    summary["questions"] = len({r["question_id"] for r in done})
    present = [n for n in names if any(r["method"] == n for r in records)]
    summary["methods"] = bench_report.summarize(records, ref, present)
    write_outputs(summary, out)
    return summary


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s, refresh=True):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    # off a terminal (nohup, CI logs) a line every 30 s instead of a redraw per run
    interval = 0.1 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True, mininterval=interval)


# ------------------------------------------------------------------------------------------- cli
def add_bench_command(sub) -> None:
    p = sub.add_parser("bench", help="Spec-Bench speedup / MAT tables for our methods and HF baselines",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default', a HF model dir, a .gguf file or a cached HF id")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated (default {DEFAULT_METHODS}); variants as name@field=value[@...], "
                        "e.g. logitspec@capacity=8 or hf-pld@prompt_lookup_num_tokens=4; ar always runs")
    p.add_argument("--questions", default=None,
                   help=f"Spec-Bench question.jsonl (default: {DEFAULT_QUESTIONS})")
    p.add_argument("--per-task", type=int, default=None, help="first N questions of each task (default: all)")
    p.add_argument("--categories", default=None,
                   help="comma-separated categories or tasks to keep (e.g. mt_bench,translation,writing)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per turn (default 64)")
    p.add_argument("--max-batch-size", type=int, default=1, help="engine batch size; a unit is that many questions")
    p.add_argument("--capacity", type=int, default=None, help="SpecConfig.capacity for the engine methods")
    p.add_argument("--top-k", type=int, default=None, help="SpecConfig.top_k for the engine methods")
    p.add_argument("--out", default="bench_out", help="output directory (default bench_out)")
    p.add_argument("--quick", action="store_true",
                   help="CI preset: 1 question per task, 16 new tokens, methods ar,logitspec,hf "
                        "(explicit options win)")
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--resume", action="store_true",
                   help="keep the complete question-turns already in --out's results.jsonl and run the rest")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="only re-render DIR's summary, report and plots from its results.jsonl (no model)")
    p.set_defaults(func=bench_command)


def bench(model="default", questions=None, out_dir="bench_out", methods: str | Sequence[str] = DEFAULT_METHODS,
          per_task: int | None = None, categories: Sequence[str] | None = None, **kwargs) -> dict:
    """Python twin of ``logitspec bench``: ``model`` is a spec for :func:`logitspec.models.load_model` or a
    ``(model, tokenizer)`` pair; ``questions`` a ``question.jsonl`` path (default: Spec-Bench beside the
    repository) or a list of :class:`Question`; other keywords go to :func:`run_bench`."""
    parse_methods(methods)  # fail on a typo before loading anything
    if questions is None or isinstance(questions, (str, os.PathLike)):
        qs = load_questions(questions, per_task, categories)
        kwargs.setdefault("settings", {"questions_file": str(questions or DEFAULT_QUESTIONS), "per_task": per_task,
                                       "categories": list(categories) if categories else None})
    else:
        qs = select_questions(list(questions), per_task, categories)
    if isinstance(model, tuple):
        model_obj, tok = model
        kwargs.setdefault("model_name", getattr(model_obj.config, "name_or_path", None) or type(model_obj).__name__)
    else:
        from .models import load_model

        model_obj, tok = load_model(model)
        kwargs.setdefault("model_name", str(model))
    return run_bench(model_obj, tok, qs, out_dir, methods, **kwargs)


def bench_command(args) -> int:
    if args.report:
        summary = rerender(args.report)
        print(_console_table(summary))
        if summary.get("partial"):
            print(f"partial: {summary['partial']}")
        return 0
    quick = QUICK if args.quick else {}
    per_task = args.per_task if args.per_task is not None else quick.get("per_task")
    max_new = args.max_new_tokens if args.max_new_tokens is not None else quick.get("max_new_tokens", 64)
    methods = [s.name for s in parse_methods(args.methods or quick.get("methods", DEFAULT_METHODS))]
    categories = _split_top(args.categories, ",") if args.categories else None
    load_questions(args.questions, per_task, categories)  # a missing file fails before the model loads
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    summary = bench(args.model, args.questions, args.out, methods, per_task, categories, max_new_tokens=max_new,
                    max_batch_size=args.max_batch_size, capacity=args.capacity, top_k=args.top_k,
                    warmup=not args.no_warmup, warmup_tokens=args.warmup_tokens, progress=not args.no_progress,
                    resume=args.resume,
                    command=_command_line(args, per_task, max_new, methods),
                    settings={"questions_file": str(args.questions or DEFAULT_QUESTIONS), "per_task": per_task,
                              "categories": categories, "quick": args.quick})
    print(_console_table(summary))
    print(f"wrote {args.out}/results.jsonl, summary.json, report.md, speedup.png, accept_hist.png")
    return 0


def _command_line(args, per_task, max_new, methods) -> str:
    """The effective command (presets resolved), so that the report says exactly what ran."""
    parts = ["logitspec", "bench", "--model", str(args.model), "--methods", ",".join(methods)]
    if args.questions:
        parts += ["--questions", str(args.questions)]
    if per_task is not None:
        parts += ["--per-task", str(per_task)]
    if args.categories:
        parts += ["--categories", args.categories]
    parts += ["--max-new-tokens", str(max_new)]
    for opt in ("max_batch_size", "capacity", "top_k", "threads"):
        v = getattr(args, opt)
        if v is not None and not (opt == "max_batch_size" and v == 1):
            parts += ["--" + opt.replace("_", "-"), str(v)]
    if args.no_warmup:
        parts.append("--no-warmup")
    elif args.warmup_tokens != 16:
        parts += ["--warmup-tokens", str(args.warmup_tokens)]
    parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(p) for p in parts)


def _console_table(summary: dict) -> str:
    cols = list(summary["tasks"]) + ["overall"]
    lines = ["method".ljust(24) + "".join(bench_report.TASK_LABELS.get(c, c)[:9].rjust(10) for c in cols)
             + "MAT".rjust(7) + "lossless".rjust(10)]
    for m, v in summary["methods"].items():
        cells = "".join((f"{v['speedup'][c]:.2f}x" if v["speedup"].get(c) is not None else "-").rjust(10) for c in cols)
        mat = v["mat"].get("overall")
        ll = v["lossless"]
        lines.append(m[:23].ljust(24) + cells + (f"{mat:.2f}" if mat is not None else "-").rjust(7)
                     + (f"{ll:.0%}" if ll is not None else "-").rjust(10))
    return "\n".join(lines)

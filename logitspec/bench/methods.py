"""Methods of ``logitspec bench``: names and variants, and one runner per method.

A method is an engine method (any of :data:`logitspec.config.METHODS`) or an HF baseline (``hf``:
``model.generate(do_sample=False)``, ``hf-pld``: with ``prompt_lookup_num_tokens=10``). A variant
overrides fields: ``logitspec@capacity=8@top_k=8`` (SpecConfig fields, plus ``history=N``: the engine
keeps its answers, up to N tokens, as a draft source, and ``datastore=DIR``: a REST datastore written by
``python -m logitspec.spec_decode.rest build``, every prompt's reference: REST retrieves from it, the other
methods
look n-grams up in it after the prompt's own context) or ``hf-pld@prompt_lookup_num_tokens=4``
(``generate`` keywords). ``ar`` is the reference.
"""
from __future__ import annotations

import ast
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Sequence

from logitspec.engine.session import sample_seed

from .report import TIME_PARTS
from .samples import Decoding, run_samples

REFERENCE = "ar"
HF_METHODS = ("hf", "hf-pld")
DEFAULT_METHODS = "ar,pld,rest,lookahead,logitspec,hf,hf-pld"
ENGINE_OPTIONS = ("history", "datastore")  # variant keys that are Engine options, not SpecConfig fields


@dataclass(frozen=True)
class MethodSpec:
    """A named method: ``base`` (an engine method or an HF baseline) plus field overrides."""

    name: str
    base: str
    overrides: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def is_hf(self) -> bool:
        return self.base in HF_METHODS


def split_top(text: str, sep: str) -> list[str]:
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
    from ..config import METHODS, SpecConfig

    items = split_top(text, ",") if isinstance(text, str) else list(text)
    spec_fields = {f.name for f in fields(SpecConfig)} - {"method"}
    specs: list[MethodSpec] = []
    for item in items:
        base, *kvs = split_top(item, "@")
        if base not in METHODS and base not in HF_METHODS:
            raise ValueError(f"unknown method {base!r}; choose from {', '.join(METHODS + HF_METHODS)}")
        overrides = {}
        for kv in kvs:
            key, eq, val = kv.partition("=")
            if not eq:
                raise ValueError(f"method variant {item!r}: expected key=value after '@', got {kv!r}")
            key = key.strip()
            if base not in HF_METHODS and key not in spec_fields | set(ENGINE_OPTIONS):
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
    """One of our engine's methods; one ``Engine.run`` call per unit."""

    def __init__(self, model, tokenizer, config, decoding: Decoding = Decoding(), history: int = 0,
                 datastore: str | None = None):
        """``history``: tokens of the engine's own answers kept as a draft source (0: none).
        ``datastore``: a REST datastore directory, every prompt's reference (None: no reference)."""
        from logitspec.engine.engine import Engine
        from logitspec.spec_decode.history import HistorySource

        self.engine = Engine(model, tokenizer, config, history=HistorySource(max_tokens=history) if history
                             else None)
        self.decoding = decoding
        self.reference = None
        if datastore:
            from logitspec.spec_decode.rest import Datastore

            self.reference = Datastore.load(datastore)

    def _target(self):
        """The engine, or a stand-in whose ``run`` passes the reference to it."""
        if self.reference is None:
            return self.engine
        engine, ref = self.engine, self.reference
        return type("WithReference", (),
                    {"run": staticmethod(lambda *a, **kw: engine.run(*a, reference=ref, **kw))})()

    def run(self, prompts: list[list[int]], max_new_tokens: int,
            seeds: list[int] | None = None) -> tuple[float, list[dict]]:
        """Wall time and one output per sample, prompt-major
        (:func:`~logitspec.bench.samples.run_samples`)."""
        dev = self.engine.runner.device
        _sync(dev)
        t0 = time.perf_counter()
        results = run_samples(self._target(), prompts, max_new_tokens, self.decoding, seeds).results
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
                "accepted_from": st["accepted_from"],
                **{p: st[p] for p in TIME_PARTS}, "engine_wall_s": st["wall_s"],
            })
        return wall, outs


class HFRunner:
    """``model.generate`` (optionally with prompt lookup), one prompt (and sample) at a time: greedy,
    or sampled with the same settings as the engine (``torch.manual_seed`` per sample: HF's own draws,
    not comparable token for token with the engine's).

    Forwards are counted with a public forward pre-hook; per-forward accepted lengths are read from
    the ``position_ids`` each forward receives (the sequence length after forward i is the next
    forward's first position + 1), and left out when a forward does not receive them.
    """

    def __init__(self, model, tokenizer, eos_ids: set[int], overrides: dict, base: str,
                 decoding: Decoding = Decoding()):
        self.model = model
        self.tokenizer = tokenizer
        self.decoding = decoding
        self.kwargs = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if not decoding.greedy:
            s = decoding.sampling
            self.kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p,
                               top_k=s.top_k or None)
        if base == "hf-pld":
            self.kwargs["prompt_lookup_num_tokens"] = 10
        self.kwargs.update(overrides)
        eos = sorted(eos_ids)
        # the same stopping tokens as the engine, so that outputs are comparable
        self.kwargs["eos_token_id"] = eos or None
        self.kwargs["pad_token_id"] = eos[0] if eos else 0
        self.eos = set(eos)

    def run(self, prompts: list[list[int]], max_new_tokens: int,
            seeds: list[int] | None = None) -> tuple[float, list[dict]]:
        """Wall time and one output per sample, prompt-major."""
        n = self.decoding.num_samples
        seeds = self.decoding.seeds(0, len(prompts)) if seeds is None else seeds
        outs, total = [], 0.0
        for ids, seed in zip(prompts, seeds):
            for j in range(n):
                wall, out = self._generate(ids, max_new_tokens, sample_seed(seed, j))
                total += wall
                outs.append(out)
        return total, outs

    def _generate(self, ids: list[int], max_new_tokens: int, seed: int) -> tuple[float, dict]:
        """One ``generate`` call: its wall time and output (forwards counted by a pre-hook)."""
        import torch

        dev = next(self.model.parameters()).device
        starts: list = []  # first position of each forward (a 1-element tensor: no device sync here)

        def hook(module, args, kwargs):
            pos = kwargs.get("position_ids")
            starts.append(pos.reshape(-1)[:1].clone() if pos is not None else None)

        x = torch.tensor([ids], device=dev)
        if not self.decoding.greedy:
            torch.manual_seed(seed)
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
        return wall, {
            "token_ids": new,
            "text": (self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer is not None
                     else None),
            "finish_reason": "stop" if new and new[-1] in self.eos else "length",
            "steps": len(starts), "decode_steps": max(len(starts) - 1, 0),
            "accept_lengths": _accept_lengths(starts, len(ids), len(new)),
            "wall_time": wall,
        }


def _accept_lengths(starts: list[int | None], prompt_len: int, new_tokens: int) -> list[int] | None:
    """Tokens emitted by each forward, from each forward's first position (None if unknown)."""
    if not starts or any(s is None for s in starts):
        return None
    lengths = [s + 1 for s in starts[1:]] + [prompt_len + new_tokens]
    emitted = [b - a for a, b in zip([prompt_len] + lengths[:-1], lengths)]
    return emitted if all(e >= 0 for e in emitted) and sum(emitted) == new_tokens else None


def describe(runner) -> dict:
    """What a method ran with: the full SpecConfig (defaults change), the model runner that ran it (its
    kind: ``eager``, or ``graph:<attention>:<capture>:<block>``) and, for the auto budget, the forward
    cost curve it used; or the ``generate`` keywords."""
    if isinstance(runner, HFRunner):
        return {"generate": {k: v for k, v in runner.kwargs.items() if v is not None}}
    eng = runner.engine
    out = {"config": asdict(eng.config), "runner": getattr(eng.runner, "kind", "eager")}
    if runner.reference is not None:
        out["datastore"] = getattr(runner.reference, "meta", {})
    curve = eng.policy.cost_curve
    if curve is not None:
        out["cost_curve"] = curve.to_dict()
    if eng.policy.auto_budget:
        out["budget_evidence"] = eng.policy.evidence_summary(eng.config.max_batch_size)
        out["budget_corrections"] = eng.policy.stats()
    return out

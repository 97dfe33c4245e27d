"""How the benchmark decodes: greedy, or sampled with several samples per prompt (the options of
``logitspec bench`` and ``logitspec throughput``), and the one function that asks the engine for
them (:func:`run_samples`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from logitspec.engine.request import Request
from logitspec.sample.params import SamplingParams


@dataclass(frozen=True)
class Decoding:
    """Greedy or sampled decoding (``sampling``) with ``num_samples`` samples per prompt. The k-th
    prompt of a run has seed ``seed + num_samples * k``; its sample j draws from the engine's
    :func:`~logitspec.engine.session.sample_seed` of that, for every method alike."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        s = self.sampling
        if self.greedy and (self.num_samples > 1 or s.top_p < 1 or s.top_k):
            raise ValueError("top-p, top-k and several samples per prompt need a temperature > 0 "
                             "(greedy samples would all be the same)")

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def seeds(self, k: int, count: int) -> list[int]:
        """Seeds of the prompts k .. k + count - 1 of a run (their sample 0's seeds)."""
        return [self.seed + self.num_samples * (k + i) for i in range(count)]

    def request(self, max_new_tokens: int) -> Request:
        """The engine request of one prompt decoded so (its seed comes from :meth:`seeds`)."""
        return Request(max_new_tokens=max_new_tokens, sampling=self.sampling, n=self.num_samples)

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        s = self.sampling
        parts = [f"temperature {s.temperature:g}", f"top-p {s.top_p:g}"]
        parts += [f"top-k {s.top_k}"] if s.top_k else []
        return ("sampled (" + ", ".join(parts)
                + f"), {self.num_samples} sample(s) per prompt, seed {self.seed}")


def add_decoding_options(p) -> None:
    """``--temperature``, ``--top-p``, ``--top-k``, ``--num-samples``, ``--seed`` (bench and throughput)."""
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (needs --temperature > 0)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens (needs --temperature > 0; 0: all). The number "
                        "of LogitSpec guesses is --guesses in bench, a method variant (logitspec@top_k=8) "
                        "elsewhere")
    p.add_argument("--num-samples", type=int, default=1,
                   help="samples per prompt (needs --temperature > 0); each is a record, seeded alike for "
                        "every method")
    p.add_argument("--seed", type=int, default=0, help="first sampling seed (prompt k: seed + N k; its "
                                                       "samples: "
                   "logitspec.engine.session.sample_seed of that)")


def decoding_from_args(args) -> Decoding:
    """The :class:`Decoding` of the options; ValueError for bad values."""
    return Decoding(SamplingParams(args.temperature, args.top_p, args.top_k), args.num_samples, args.seed)


def decoding_options(d: Decoding) -> list[str]:
    """The options that give ``d`` (none for greedy)."""
    if d.greedy:
        return []
    s = d.sampling
    out = ["--temperature", f"{s.temperature:g}", "--top-p", f"{s.top_p:g}"]
    out += ["--top-k", str(s.top_k)] if s.top_k else []
    out += ["--num-samples", str(d.num_samples)] if d.num_samples > 1 else []
    return out + (["--seed", str(d.seed)] if d.seed else [])


def run_samples(engine, prompts: list, max_new_tokens: int, decoding: Decoding,
                seeds: list[int] | None = None):
    """``engine.run`` on ``decoding.num_samples`` samples of every prompt, one prefill shared by a
    prompt's samples: the :class:`~logitspec.engine.engine.EngineRun`'s results are prompt-major (sample j
    of prompt i at ``i * num_samples + j``, seeded ``sample_seed(seeds[i], j)``; ``seeds`` default:
    :meth:`Decoding.seeds` from 0)."""
    seeds = decoding.seeds(0, len(prompts)) if seeds is None else seeds
    return engine.run(prompts, decoding.request(max_new_tokens), seed=list(seeds))

"""What one prompt asks for: the public request type, from the command line to the batch.

A :class:`Request` holds everything that may differ between rows of one batch: the sampling settings
(:class:`SamplingParams`), the seed, the token limit, stop strings and the number of samples. Every
command line declares its sampling flags through :func:`add_request_flags` and reads them back with
:func:`request_from_args`, so a flag means the same thing everywhere. A request serialises to a plain
dict (:meth:`Request.to_dict` / :meth:`Request.from_dict`) for job specs and Ray calls.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

from logitspec.sample.params import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k")  # a request's flat names for its SamplingParams


@dataclass(frozen=True)
class Request:
    """One prompt's settings. ``sampling``: how its tokens are chosen. ``seed``: None takes the
    session's seed plus the request id; sample j of a request seeded s draws with
    ``session.sample_seed(s, j)``. ``stop``: strings that end a sample (not part of its text). ``n``:
    samples of the prompt, sharing one prefill. :meth:`make`, :meth:`with_` and the dict form take the
    sampling settings by their flat names (``temperature``, ``top_p``, ``top_k``)."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, not {type(self.sampling).__name__}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @classmethod
    def make(cls, **fields: Any) -> "Request":
        """A request from flat fields: its own, and ``temperature``, ``top_p``, ``top_k``."""
        return cls().with_(**fields)

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def with_(self, **changes: Any) -> "Request":
        """A copy with ``changes`` applied (validated again); sampling settings by their flat names."""
        flat = {k: changes.pop(k) for k in SAMPLING_FIELDS if k in changes}
        if flat:
            changes["sampling"] = replace(changes.get("sampling", self.sampling), **flat)
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values, flat (``stop`` as a list)."""
        d = {k: getattr(self, k) for k in ("max_new_tokens", "seed", "n")}
        d.update(asdict(self.sampling), stop=list(self.stop))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Request":
        """The inverse of :meth:`to_dict`; unknown keys are an error (a typo must not pass silently)."""
        unknown = set(d) - (set(cls.__dataclass_fields__) - {"sampling"}) - set(SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"unknown request fields: {', '.join(sorted(unknown))}")
        return cls.make(**{k: tuple(v) if k == "stop" else v for k, v in d.items()})


def add_request_flags(parser: argparse.ArgumentParser, *, max_new_tokens: int = 128, seed: int = 0,
                      samples: bool = True, stop: bool = True) -> None:
    """The sampling flags every command line shares: ``--max-new-tokens``, ``--temperature``,
    ``--top-p``, ``--top-k``, ``--seed`` and (unless switched off) ``--num-samples`` and ``--stop``."""
    g = parser.add_argument_group("decoding (per request)")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help="new tokens per sample at most (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 decodes greedily (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the most likely tokens holding this probability mass; "
                        "needs --temperature > 0 (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens; 0 keeps all; needs --temperature > 0 "
                        "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=seed,
                   help="base seed: prompt i is seeded seed + i, so a row's samples do not depend on "
                        "its batch (default: %(default)s)")
    if samples:
        g.add_argument("--num-samples", type=int, default=1,
                       help="samples per prompt, sharing one prefill; needs --temperature > 0 "
                            "(default: %(default)s)")
    if stop:
        g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="a string that ends a sample (repeatable; not part of the text)")


def request_from_args(args: argparse.Namespace) -> Request:
    """The :class:`Request` of flags declared by :func:`add_request_flags`; ValueError for bad values,
    including settings that only make sense when sampling (top-p, top-k, several samples) without a
    temperature."""
    n = getattr(args, "num_samples", 1)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    req = Request(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                  stop=tuple(getattr(args, "stop", None) or ()), n=n)
    if req.greedy and (sampling.top_p < 1 or sampling.top_k or req.n > 1):
        raise ValueError("--top-p, --top-k and --num-samples > 1 need --temperature > 0 "
                         "(greedy decoding gives every sample the same tokens)")
    return req


PER_PROMPT = ("seed", "n")  # run()'s fields that may also be given as one value per prompt


def per_prompt_requests(count: int, request: "Request | Sequence[Request] | None",
                        fields: dict[str, Any]) -> tuple[list[Request], int]:
    """The :class:`Request` of each of ``count`` prompts, and the base seed of their session, from
    ``Engine.run``'s arguments: ``request`` (one for all, or one per prompt) with ``fields`` applied
    on top (``seed`` and ``n`` may be one value per prompt). An int seed (a single request's, or
    ``fields``') is a base: prompt i is seeded base + i (its request keeps seed None, which the
    session resolves so). ValueError for unknown fields or lists of the wrong length."""
    unknown = set(fields) - set(Request.__dataclass_fields__) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unexpected request fields: {', '.join(sorted(unknown))}")
    if request is None or isinstance(request, Request):
        one = request or Request()
        base = one.seed if one.seed is not None else 0
        requests = [one.with_(seed=None)] * count
    else:
        requests, base = list(request), 0
        if len(requests) != count:
            raise ValueError("one request per prompt, or one for all")
    given = {k: v for k, v in fields.items() if not (k == "stop" and v is None)}
    seed = given.pop("seed", None)
    if isinstance(seed, int):
        base, seed = seed, None
    per = {k: given.pop(k) for k in PER_PROMPT if k in given and not isinstance(given[k], int)}
    if seed is not None:
        per["seed"] = seed
    per = {k: list(v) for k, v in per.items()}
    if any(len(v) != count for v in per.values()):
        raise ValueError("seed, reference and n lists must have one entry per prompt")
    if given or per:
        requests = [q.with_(**given, **{k: v[i] for k, v in per.items()}) for i, q in enumerate(requests)]
    return requests, base

"""The public request type: validation, serialisation, and the shared command-line flags."""
import argparse

import pytest

from logitspec.engine.request import Request, add_request_flags, request_from_args
from logitspec.sample.params import SamplingParams


def test_request_validates_every_field():
    for bad in ({"temperature": -1}, {"temperature": float("nan")}, {"top_p": 0}, {"top_p": 1.5},
                {"top_k": -1}, {"max_new_tokens": 0}, {"n": 0}, {"stop": ("",)}):
        with pytest.raises(ValueError):
            Request.make(**bad)


def test_request_round_trips_through_a_dict_and_refuses_unknown_keys():
    r = Request.make(max_new_tokens=7, temperature=0.8, top_p=0.9, top_k=5, seed=3, stop=["\n\n"], n=2)
    assert r.stop == ("\n\n",)
    assert Request.from_dict(r.to_dict()) == r
    assert r.sampling == SamplingParams(0.8, 0.9, 5) and not r.greedy
    with pytest.raises(ValueError, match="temprature"):
        Request.from_dict({"temprature": 1.0})
    assert Request(stop="END").stop == ("END",)


def test_flags_make_the_same_request_everywhere():
    p = argparse.ArgumentParser()
    add_request_flags(p, max_new_tokens=64)
    args = p.parse_args(["--temperature", "0.7", "--top-p", "0.95", "--num-samples", "4", "--stop", "x",
                         "--stop", "y", "--seed", "9"])
    assert request_from_args(args) == Request(64, SamplingParams(0.7, 0.95, 0), 9, ("x", "y"), 4)
    assert "default: 64" in p.format_help()
    with pytest.raises(ValueError, match="temperature > 0"):
        request_from_args(p.parse_args(["--num-samples", "4"]))

"""``logitspec throughput``: batch filling, option checks, and the vLLM baseline's runner and reader."""
from __future__ import annotations

import json
import sys

import pytest

from logitspec import allocator
from logitspec.bench import throughput, vllm_baseline, vllm_runner


def test_batch_prompts_fill_every_row():
    p = [[1], [2], [3]]
    assert throughput.batch_prompts(p, 1) == p and throughput.batch_prompts(p, 3) == p
    assert throughput.batch_prompts(p, 4) == p * 2 and len(throughput.batch_prompts(p, 24)) == 24


def test_batch_sizes_and_vllm_methods_are_checked():
    assert throughput.parse_sizes("1,6,24") == [1, 6, 24]
    for bad in ("", "0,2", "1,x"):
        with pytest.raises(ValueError, match="--batch-sizes"):
            throughput.parse_sizes(bad)
    assert vllm_baseline.parse_methods("plain, ngram") == ["plain", "ngram"]
    with pytest.raises(ValueError, match="known: plain, ngram, suffix"):
        vllm_baseline.parse_methods("plain,eagle")


def test_bad_options_fail_before_the_model_loads(tmp_path, capsys):
    from logitspec.cli import main

    missing = str(tmp_path / "no-model")  # loading it would fail differently
    assert main(["throughput", "--model", missing, "--baselines", "sglang"]) == 2
    assert "unknown baselines ['sglang']" in capsys.readouterr().err
    assert main(["throughput", "--model", missing, "--baselines", "vllm", "--vllm-methods", "eagle"]) == 2
    assert main(["throughput", "--model", missing, "--batch-sizes", "0"]) == 2
    assert main(["throughput", "--model", missing, "--prompts-per-slot", "0"]) == 2
    assert "--prompts-per-slot must be >= 1" in capsys.readouterr().err
    assert main(["throughput", "--model", missing, "--methods", "ar,logitspec@no_such_field=1"]) == 2
    assert "not a SpecConfig field" in capsys.readouterr().err
    assert main(["throughput", "--model", missing, "--methods", "ar,hf"]) == 2
    assert "engine's methods and SpecConfig variants only" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not a dtype the harness runs
        main(["throughput", "--model", missing, "--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_missing_vllm_environment_is_skipped_with_a_message(tmp_path, capsys, monkeypatch):
    """The table of our methods still comes out; the message says where vLLM was looked for."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from logitspec.cli import main

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None,
                      bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [[5, 6, 7, 5, 6, 7, 5]]}) + "\n")
    absent = tmp_path / "venv" / "bin" / "python"
    rc = main(["throughput", "--model", str(tmp_path / "tiny"), "--questions", str(q), "--methods", "ar",
               "--batch-sizes", "1,2", "--max-new-tokens", "3", "--rounds", "1", "--baselines", "vllm",
               "--vllm-python", str(absent), "--out", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    assert rc == 0 and f"vLLM baseline skipped: no python at {absent}" in out
    assert "| 2 | ar |" in out and "vllm" not in json.dumps(json.loads((tmp_path / "t.json").read_text()))


FAKE_RUNNER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("runner", sys.argv[1])
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)
req = json.load(open(sys.argv[2]))
with open(SEEN, "a") as f:
    f.write(json.dumps(req) + "\\n")
if req["method"] == "ngram":
    print("no such engine", flush=True)
    sys.exit(3)
runner.write_json(req["reply"], {"method": req["method"], "engine_init_s": 1.5})
runner.announce(req["reply"])
# new ids: the prompt reversed, cut to max_new_tokens; one token fewer for prompt [9]
gen = lambda group: [list(p[::-1])[:req["max_new_tokens"]] if p != [9] else [] for p in group]
runner.serve(gen, sys.stdin, runner.announce, clock=iter(range(0, 1000, 2)).__next__)
"""


def fake_vllm_python(tmp_path):
    """A stand-in for vLLM's python: runs the real runner's protocol (:func:`vllm_runner.serve`)
    with a deterministic generate; records each request in ``tmp_path / "seen"``; ngram fails to start."""
    script = tmp_path / "fake_runner.py"
    script.write_text(FAKE_RUNNER.replace("SEEN", repr(str(tmp_path / "seen"))))
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    fake.chmod(0o755)
    return fake


def test_runner_serves_rounds_until_an_empty_line(tmp_path):
    calls, said = [], []

    def generate(group):
        calls.append(len(group))
        return [[7] * len(p) for p in group]

    cmds = [json.dumps({"batch_size": 2, "prompts": [[1, 2], [3], [4]], "reply": str(tmp_path / "a.json")}),
            json.dumps({"batch_size": 2, "prompts": [[1]] * 5, "slots": True,
                        "reply": str(tmp_path / "b.json")}),
            "", json.dumps({"batch_size": 1, "prompts": [[1]], "reply": str(tmp_path / "c.json")})]
    assert vllm_runner.serve(generate, cmds, said.append, clock=iter(range(0, 100, 2)).__next__) == 2
    assert calls == [2, 1, 5] and said == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    a = json.loads((tmp_path / "a.json").read_text())  # batch b: consecutive groups of b prompts
    assert a["tokens"] == 4 and a["wall_s"] == 2 and a["tokens_per_s"] == 2.0 and a["token_ids"] == [[7, 7],
                                                                                                     [7], [7]]
    assert json.loads((tmp_path / "b.json").read_text())["tokens"] == 5  # slots: all prompts in one call
    assert not (tmp_path / "c.json").exists()


def test_resident_runners_alternate_with_our_rounds_and_compare_outputs(tmp_path, capsys):
    """The runners' process protocol end to end (a stand-in python running the real serve loop):
    one runner per method serves every batch size, its rounds rotate with ours, its rows carry
    paired ratios and the output check; a method that fails to start is reported and left out."""
    import contextlib

    from tiny_models import tiny_model

    model = tiny_model("llama")
    prompts = [[5, 6, 7, 5, 6], [9]]
    with contextlib.ExitStack() as stack:
        runners = vllm_baseline.start_runners(fake_vllm_python(tmp_path), tmp_path, ["plain", "ngram"],
                                              [1, 2], 4, [1, 2], stack, log=lambda _: None, dtype="bfloat16")
        assert set(runners) == {("vllm-plain", 1), ("vllm-plain", 2)}
        assert runners[("vllm-plain", 1)] is runners[("vllm-plain", 2)]
        table = throughput.run(model, None, prompts, ["ar"], [1, 2], max_new_tokens=4, rounds=3,
                               baselines=runners)
    assert "vLLM ngram skipped: vLLM runner (ngram) failed with exit code 3" in capsys.readouterr().err
    requests = [json.loads(line) for line in (tmp_path / "seen").read_text().splitlines()]
    assert [(r["method"], r["max_num_seqs"], r["dtype"], r["max_new_tokens"]) for r in requests] == [
        ("plain", 2, "bfloat16", 4), ("ngram", 2, "bfloat16", 4)]
    assert list(table) == ["ar@1", "vllm-plain@1", "ar@2", "vllm-plain@2"]
    row = table["vllm-plain@2"]
    assert row["token_ids"] == [[6, 5, 7, 6], []] and row["mat"] is None
    assert row["same_as_ar"] == (table["ar@2"]["token_ids"] == row["token_ids"])
    assert len(row["rounds"]) == 3 and row["vs_ar_paired"] == pytest.approx(
        sorted(v / a for v, a in zip(row["rounds"], table["ar@2"]["rounds"]))[1])
    assert "| 2 | vllm-plain |" in throughput.render(table)


def test_a_baseline_that_fails_mid_run_is_dropped_and_ours_stand(capsys):
    from tiny_models import tiny_model

    class Broken:
        def round(self, batch_size, prompts, slots=False):
            raise RuntimeError("engine died")

    table = throughput.run(tiny_model("llama"), None, [[5, 6, 7]], ["ar"], [1], max_new_tokens=2, rounds=2,
                           baselines={("vllm-plain", 1): Broken()})
    assert list(table) == ["ar@1"] and "vllm-plain dropped: engine died" in capsys.readouterr().err


def test_baseline_rows_say_how_our_best_method_compares_round_by_round():
    """Each baseline row carries our best method at its batch size (highest median), the ratio of the
    medians and each round's own ratio; the report counts the rounds we were ahead."""
    from tiny_models import tiny_model

    class Scripted:  # a baseline whose rounds run at the given speeds
        def __init__(self, speeds):
            self.speeds = iter(speeds)

        def round(self, batch_size, prompts, slots=False):
            return {"tokens_per_s": next(self.speeds), "token_ids": [[1, 2]] * len(prompts)}

    table = throughput.run(tiny_model("llama"), None, [[5, 6, 7, 5, 6]], ["ar", "pld"], [1], max_new_tokens=2,
                           rounds=3, baselines={("vllm-plain", 1): Scripted([1.0, 1e12, 2.0])})
    row = table["vllm-plain@1"]
    best = max((table["ar@1"], table["pld@1"]), key=lambda r: r["tokens_per_s"])
    assert row["our_best"] == best["method"]
    assert row["vs_our_best"] == pytest.approx(best["tokens_per_s"] / 2.0)
    assert row["our_best_per_round"] == pytest.approx([o / v for o, v in zip(best["rounds"],
                                                                             [1.0, 1e12, 2.0])])
    assert "our_best" not in table["ar@1"]
    report = throughput.render(table)
    assert f"| 1 | {best['method']} | vllm-plain | " in report and "| 2 of 3 |" in report


def test_runner_environment_binds_all_threads_and_hides_our_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_baseline.runner_env(tmp_path / "bin" / "python", threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    tcmalloc = [p for p in [allocator.library()] if p]
    assert "PYTHONPATH" not in env and env["LD_PRELOAD"] == ":".join(tcmalloc + [str(tmp_path / "lib"
                                                                                     / "libiomp5.so")])
    # our own process on tcmalloc (the logitspec command preloads it): the runner still gets Intel OpenMP
    monkeypatch.setenv("LD_PRELOAD", "/x/libtcmalloc_minimal.so.4")
    got = vllm_baseline.runner_env(tmp_path / "bin" / "python", threads=2)["LD_PRELOAD"].split(":")
    assert got == ["/x/libtcmalloc_minimal.so.4", str(tmp_path / "lib" / "libiomp5.so")]


def test_a_failing_vllm_start_is_reported_and_skipped(tmp_path, capsys):
    """The real runner script under a python without vLLM: the child fails at its import, the
    error reaches the user, no runner is left."""
    import contextlib

    with contextlib.ExitStack() as stack:
        runners = vllm_baseline.start_runners(sys.executable, tmp_path, ["plain"], [1], 4, [1, 2], stack,
                                              threads=1, log=lambda _: None)
    err = capsys.readouterr().err
    assert runners == {} and "vLLM plain skipped: vLLM runner (plain) failed" in err and "vllm" in err.lower()


def test_runner_passes_the_context_length_and_one_runner_per_slot_size(tmp_path):
    import contextlib

    fake = fake_vllm_python(tmp_path)
    with vllm_baseline.Runner(fake, tmp_path, "plain", 1, 3, [1], max_model_len=4096) as r:
        assert r.engine_init_s == 1.5 and r.round(1, [[1, 2, 3]])["token_ids"] == [[3]]
    with contextlib.ExitStack() as stack:
        runners = vllm_baseline.start_runners(fake, tmp_path, ["plain"], [1, 4], 1, [1], stack, slots=True,
                                              log=lambda _: None)
        assert runners[("vllm-plain", 4)].round(4, [[1, 2]] * 8, slots=True)["tokens"] == 8
    requests = [json.loads(line) for line in (tmp_path / "seen").read_text().splitlines()]
    assert requests[0]["max_model_len"] == 4096 and requests[0]["dtype"] == "float32"
    assert "max_model_len" not in requests[1]  # the runner's default
    assert [r["max_num_seqs"] for r in requests] == [3, 1, 4]  # slots: vLLM's row limit is each batch size


def test_prompts_per_slot_refills_the_slots_and_keeps_outputs_exact():
    from tiny_models import repetitive_prompts, tiny_model

    model = tiny_model("llama")
    prompts = repetitive_prompts(3, seed=4)
    table = throughput.run(model, None, prompts, ["ar", "logitspec"], [2], max_new_tokens=8, rounds=1,
                           prompts_per_slot=3)
    row = table["logitspec@2"]
    assert len(row["token_ids"]) == 6 and row["same_as_ar"]  # 2 slots x 3 prompts each, refilled

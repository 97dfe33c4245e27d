"""``logitspec throughput``: batch filling, option checks, and the vLLM baseline's runner and reader."""
from __future__ import annotations

import json
import os

import pytest

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
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
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


def test_runner_record_is_read_back_into_table_rows(tmp_path):
    """The runner's own measuring and writing code (vLLM's generate replaced by a deterministic
    one), read back by the host side: medians, batches, and outputs compared with ours."""
    calls = []

    def generate(group):  # new ids: the prompt reversed, one token fewer for prompt [9]
        calls.append(len(group))
        return [list(p[::-1]) if p != [9] else [] for p in group]

    ticks = iter(range(100))
    prompts = {"1": [[1, 2], [9]], "2": [[1, 2], [9], [1, 2], [9]]}
    runs = vllm_runner.measure(generate, prompts, rounds=2, clock=lambda: 2.0 * next(ticks))
    assert calls == [1, 1, 2, 2] * 2  # batch b: consecutive groups of b prompts
    vllm_runner.write_record(tmp_path / "r.json", "ngram", 12.5, runs)
    res = vllm_baseline.read_result((tmp_path / "r.json").read_text())
    assert res["method"] == "ngram" and res["engine_init_s"] == 12.5
    assert res["batches"][1]["rounds"] == [1.0, 1.0] and res["batches"][2]["tokens_per_s"] == 2.0
    assert res["batches"][2]["token_ids"] == [[2, 1], [], [2, 1], []]
    ours = {"ar@1": {"tokens_per_s": 4.0, "token_ids": [[2, 1], []]},
            "ar@2": {"tokens_per_s": 1.0, "token_ids": [[2, 1], [3], [2, 1], []]}}
    rows = vllm_baseline.table_rows(res, ours)
    assert list(rows) == ["vllm-ngram@1", "vllm-ngram@2"]
    assert rows["vllm-ngram@1"]["vs_ar"] == 0.25 and rows["vllm-ngram@1"]["same_as_ar"] is True
    assert rows["vllm-ngram@2"]["same_as_ar"] is False and rows["vllm-ngram@2"]["mat"] is None
    assert "| 2 | vllm-ngram | 2.00 | 2.00x | - | - | False |" in throughput.render(rows)  # not run in our rounds: no pairs
    with pytest.raises(ValueError, match="not a vLLM runner result"):
        vllm_baseline.read_result(json.dumps({"method": "plain", "runs": [{"batch_size": 1}]}))


def test_runner_slots_send_all_prompts_in_one_call_and_the_host_one_batch_size_per_run(tmp_path):
    """With slots the runner hands vLLM all of a batch size's prompts at once (its scheduler keeps
    b running), and the host starts one runner per batch size, each told its one size."""
    calls = []

    def generate(group):
        calls.append(len(group))
        return [[1]] * len(group)

    runs = vllm_runner.measure(generate, {"2": [[1]] * 8}, rounds=2, clock=iter(range(100)).__next__, slots=True)
    assert calls == [8, 8] and [r["tokens"] for r in runs] == [8, 8]
    seen = tmp_path / "seen"
    fake = tmp_path / "python"  # records each request, answers like the runner for its one batch size
    fake.write_text("#!/bin/sh\ncat \"$2\" >> " + str(seen) + "\necho >> " + str(seen) + "\n"
                    "b=$(sed 's/.*\"prompts\": {\"\\([0-9]*\\)\".*/\\1/' \"$2\")\n"
                    "echo '{\"method\": \"plain\", \"engine_init_s\": 1, \"runs\": [{\"batch_size\": '$b', "
                    "\"round\": 0, \"tokens\": 4, \"wall_s\": 1, \"token_ids\": [[7]]}]}' > \"$3\"\n")
    fake.chmod(0o755)
    rows = vllm_baseline.run_all(fake, tmp_path, ["plain"], {1: [[1]] * 3, 2: [[1]] * 6}, 1, 1, [1], ours={},
                                 log=lambda _: None, slots=True)
    requests = [json.loads(line) for line in seen.read_text().splitlines() if line.strip()]
    assert [list(r["prompts"]) for r in requests] == [["1"], ["2"]] and all(r["slots"] for r in requests)
    assert list(rows) == ["vllm-plain@1", "vllm-plain@2"] and rows["vllm-plain@2"]["tokens_per_s"] == 4.0
    with pytest.raises(ValueError, match="one batch size per vLLM run"):
        vllm_baseline.run_method(fake, tmp_path, "plain", {1: [[1]], 2: [[1]]}, 1, 1, [1], slots=True)


def test_runner_environment_binds_all_threads_and_hides_our_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_baseline.runner_env(tmp_path / "bin" / "python", threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    tcmalloc = [p for p in vllm_baseline.TCMALLOC if os.path.exists(p)][:1]
    assert "PYTHONPATH" not in env and env["LD_PRELOAD"] == ":".join(tcmalloc + [str(tmp_path / "lib" / "libiomp5.so")])


def test_a_failing_vllm_run_is_reported_and_skipped(tmp_path, capsys):
    """The real runner script under a python without vLLM: the child fails at its import, the
    error reaches the user, the table keeps our rows."""
    import sys

    rows = vllm_baseline.run_all(sys.executable, tmp_path, ["plain"], {1: [[1, 2, 3]]}, 4, 1, [1, 2], ours={},
                                 threads=1, log=lambda _: None)
    err = capsys.readouterr().err
    assert rows == {} and "vLLM plain skipped: vLLM runner (plain) failed" in err and "vllm" in err.lower()


def test_run_method_passes_the_context_length_and_reads_the_result(tmp_path):
    """A stand-in python that records the runner's request and answers like the runner."""
    seen = tmp_path / "request.json"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncp \"$2\" {seen}\n"
                    "echo '{\"method\": \"plain\", \"engine_init_s\": 1.5, \"runs\": [{\"batch_size\": 1, "
                    "\"round\": 0, \"tokens\": 1, \"wall_s\": 0.5, \"token_ids\": [[7]]}]}' > \"$3\"\n")
    fake.chmod(0o755)
    res = vllm_baseline.run_method(fake, tmp_path, "plain", {1: [[1, 2, 3]]}, 1, 1, [1], max_model_len=4096)
    assert json.loads(seen.read_text())["max_model_len"] == 4096
    assert res["batches"][1]["tokens_per_s"] == 2.0 and res["batches"][1]["token_ids"] == [[7]]
    vllm_baseline.run_method(fake, tmp_path, "plain", {1: [[1, 2, 3]]}, 1, 1, [1])
    assert "max_model_len" not in json.loads(seen.read_text())  # the runner's default
    assert json.loads(seen.read_text())["dtype"] == "float32"
    vllm_baseline.run_method(fake, tmp_path, "plain", {1: [[1, 2, 3]]}, 1, 1, [1], dtype="bfloat16")
    assert json.loads(seen.read_text())["dtype"] == "bfloat16"


def test_prompts_per_slot_refills_the_slots_and_keeps_outputs_exact():
    from tiny_models import repetitive_prompts, tiny_model

    model = tiny_model("llama")
    prompts = repetitive_prompts(3, seed=4)
    table = throughput.run(model, None, prompts, ["ar", "logitspec"], [2], max_new_tokens=8, rounds=1,
                           prompts_per_slot=3)
    row = table["logitspec@2"]
    assert len(row["token_ids"]) == 6 and row["same_as_ar"]  # 2 slots x 3 prompts each, refilled

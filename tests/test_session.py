"""The engine loop: several samples per prompt from one prefill, the streaming session, prefill
interleaved with decoding, and the prefix cache. Greedy output always equals plain decoding."""
import pytest
from tiny_models import hf_greedy, repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.engine.request import Request
from logitspec.engine.sequence import DecodingSequence
from logitspec.engine.session import sample_seed
from logitspec.engine.stats import RATE_STEPS
from logitspec.sample.params import SamplingParams
from logitspec.worker.prefix_cache import PrefixCache

N_NEW = 16


def _spy(engine) -> list:
    """Log of the engine's forwards: ("P", chunk tokens) per prefill chunk of one prompt, ("G", [prompt
    lengths]) per forward prefilling several short prompts together, ("D", rows) per decoding step."""
    log = []
    runner = engine.runner
    extend, prefill_rows, decode = runner.extend, runner.prefill_rows, runner.step

    def spy_extend(row, tokens, **flags):
        log.append(("P", len(tokens)))
        return extend(row, tokens, **flags)

    def spy_prefill_rows(prompts, **flags):
        log.append(("G", [len(p) for p in prompts]))
        return prefill_rows(prompts, **flags)

    def spy_decode(rows, *a):
        log.append(("D", len(rows)))
        return decode(rows, *a)

    runner.extend, runner.prefill_rows, runner.step = spy_extend, spy_prefill_rows, spy_decode
    return log


def _prompts_prefilled(log) -> int:
    """Prompts whose prefill ran in one forward (alone or in a group)."""
    return sum(1 if kind == "P" else len(n) for kind, n in log if kind in "PG")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# ---------------------------------------------------------------- n samples per prompt
def test_greedy_samples_share_one_prefill(llama):
    prompts = repetitive_prompts(3, seed=4)
    eng = Engine(llama, None, SpecConfig(method="logitspec", max_batch_size=4, budget="fixed"))
    log = _spy(eng)
    run = eng.run(prompts, max_new_tokens=N_NEW, n=3)
    assert _prompts_prefilled(log) == len(prompts)  # each prompt fits one chunk: prefilled once
    refs = [hf_greedy(llama, p, N_NEW) for p in prompts]
    assert [(r.request_id, r.sample_index) for r in run.results] == [(i, j) for i in range(3)
                                                                     for j in range(3)]
    assert [r.token_ids for r in run.results] == [ref for ref in refs for _ in range(3)]
    assert [r.stats["shared_prefill"] for r in run.results] == [False, True, True] * 3
    assert all(r.stats["prefill_s"] == 0.0 for r in run.results if r.sample_index > 0)
    assert all(r.stats["prefill_s"] > 0.0 for r in run.results if r.sample_index == 0)


def test_sampled_samples_are_seeded_and_batch_independent():
    model = tiny_model("qwen2")
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9]]
    kw = dict(max_new_tokens=N_NEW, temperature=1.0, top_p=0.95, n=3)
    both = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=4)).generate(prompts,
                                                                                          seed=[11, 12], **kw)
    alone = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=2)).generate(prompts[1:],
                                                                                           seed=[12], **kw)
    assert [r.token_ids for r in both[3:]] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in alone}) == 3  # the samples differ from one another
    single = Engine(model, None, SpecConfig(method="logitspec")).generate(
        prompts[1:], seed=[12], **{**kw, "n": 1})
    assert single[0].token_ids == alone[0].token_ids  # sample 0 uses the prompt's seed itself
    assert sample_seed(12, 0) == 12 and len({sample_seed(12, j) for j in range(50)}) == 50


@pytest.mark.parametrize("siblings", [True, False])
def test_samples_draft_from_their_siblings_answers(llama, siblings):
    """One slot, so a prompt's samples run one after another: the later ones retrieve from the
    earlier ones' answers (greedy: the same answer) and accept those drafts; output unchanged."""
    prompt = [[3, 17, 41, 8, 60, 25, 11]]
    cfg = SpecConfig(method="logitspec", max_batch_size=1, budget="fixed", sibling_drafts=siblings)
    res = Engine(llama, None, cfg).generate(prompt, max_new_tokens=N_NEW, n=3)
    assert [r.token_ids for r in res] == [hf_greedy(llama, prompt[0], N_NEW)] * 3
    from_siblings = [r.stats["accepted_from"]["siblings"] for r in res]
    assert from_siblings[0] == 0  # no sibling had an answer while sample 0 ran
    if siblings:
        assert all(n > 0 for n in from_siblings[1:]), from_siblings
        assert res[2].stats["steps"] < res[0].stats["steps"]
    else:
        assert from_siblings == [0, 0, 0]


def test_n_below_one_fails_before_any_forward(llama):
    eng = Engine(llama, None, SpecConfig(method="ar"))
    log = _spy(eng)
    with pytest.raises(ValueError, match="n \\(samples per prompt\\)"):
        eng.generate([[1, 2, 3]], n=0)
    assert log == []


# ---------------------------------------------------------------- streaming session
def test_session_keeps_the_batch_full_and_equals_run(llama):
    """With ``refill_wait=0`` every free slot is refilled at once."""
    prompts = repetitive_prompts(8, seed=6)
    cfg = SpecConfig(method="logitspec", max_batch_size=3, budget="fixed", refill_wait=0)
    ref = [r.token_ids for r in Engine(llama, None, cfg).generate(prompts, max_new_tokens=N_NEW)]
    eng = Engine(llama, None, cfg)
    log = _spy(eng)
    session = eng.open(Request(max_new_tokens=N_NEW))
    feed, results, ids = list(prompts), {}, []
    while feed or session.busy:
        while feed and session.free_slots > 0:  # a caller that tops the batch up as rows finish
            ids.append(session.submit(feed.pop(0)))
        feeding = bool(feed)
        n_decodes = sum(1 for kind, _ in log if kind == "D")
        results.update({r.request_id: r.token_ids for r in session.step()})
        new = [rows for kind, rows in log if kind == "D"][n_decodes:]
        if feeding:  # while prompts remain, every decoding step runs a full batch
            assert new == [3]
    assert ids == list(range(8))
    assert [results[i] for i in ids] == ref


@pytest.mark.parametrize("runner", ["eager", "graph"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prefilling_while_a_step_is_queued_changes_no_token(llama, runner, temperature, monkeypatch):
    """``overlap`` (a GPU engine's default): while rows decode, the next prompts are prefilled after a
    decided step's forward is queued and before its result is read, and admitted at the next step.
    Every row's tokens are those of the plain order (greedy, and sampled with the same seeds; eager
    and graph runner). A prefill runs between a step's forward and its acceptance exactly where the
    step is decided inside the graph runner's step (greedy): other steps hold their [N, V] logits,
    which a prefill beside them would keep alive, and run the plain order's forwards, none skipped."""
    from logitspec.engine import session as session_module
    from logitspec.worker.gpu import GraphRunner

    prompts = repetitive_prompts(8, seed=6)
    cfg = SpecConfig(method="logitspec", max_batch_size=3, budget="fixed", refill_wait=0)
    out, forwards, beside = {}, {}, {}
    accept = session_module.accept_step
    for overlap in (False, True):
        kw = {"runner": GraphRunner(llama, max_rows=3, max_len=256, decide_top=cfg.top_k + 1)
              } if runner == "graph" else {}
        eng = Engine(llama, None, cfg, overlap=overlap, **kw)
        log = _spy(eng)
        monkeypatch.setattr(session_module, "accept_step",
                            lambda *a, **k: log.append(("A", 0)) or accept(*a, **k))
        session = eng.open(Request.make(max_new_tokens=N_NEW, temperature=temperature, seed=3))
        for p in prompts:
            session.submit(p)
        results = {}
        while session.busy:
            results.update({r.request_id: r.token_ids for r in session.step()})
        kinds = "".join(k for k, _ in log)  # D: a step's forward, A: its acceptance, P/G: prefill forwards
        out[overlap], forwards[overlap] = [results[i] for i in range(len(prompts))], kinds.replace("A", "")
        beside[overlap] = any(c in "PG" for part in kinds.split("D")[1:] for c in part.split("A")[0])
    assert out[True] == out[False]
    decided = runner == "graph" and temperature == 0.0
    assert beside[True] == decided and not beside[False]
    assert decided or forwards[True] == forwards[False]


def test_rows_finishing_one_by_one_are_refilled_together(llama):
    """Rows that finish at different steps: by default free slots wait for company (at most about
    ``refill_wait`` steps of the whole batch), so fewer prefill forwards refill them; the outputs are
    the same as refilling each slot at once."""
    prompts = repetitive_prompts(12, seed=9)
    B = 4
    forwards, outputs = {}, {}
    for wait in (0, None, 2.0):
        extra = {} if wait is None else {"refill_wait": wait}
        eng = Engine(llama, None, SpecConfig(method="logitspec", max_batch_size=B, budget="fixed", **extra))
        log = _spy(eng)
        session = eng.open(Request(max_new_tokens=N_NEW))
        for i, p in enumerate(prompts):  # each its own length: rows finish one by one
            session.submit(p, Request(max_new_tokens=3 + i))
        outputs[wait] = {r.request_id: r.token_ids for r in session.drain()}
        groups = [i for i, (kind, _) in enumerate(log) if kind == "G"]
        forwards[wait] = len(groups)
        for a, b in zip(groups, groups[1:]):  # free slot-steps between two refills stay bounded
            idle = sum(B - n for kind, n in log[a + 1:b] if kind == "D")
            assert idle <= eng.config.refill_wait * B + B, (wait, idle)
    assert outputs[None] == outputs[0] == outputs[2.0]
    assert [outputs[0][i] for i in range(len(prompts))] == [hf_greedy(llama, p, 3 + i)
                                                            for i, p in enumerate(prompts)]
    assert forwards[0] >= forwards[None] >= forwards[2.0] and forwards[0] > forwards[2.0]


def test_refill_wait_must_not_be_negative():
    with pytest.raises(ValueError, match="refill_wait"):
        SpecConfig(method="ar", refill_wait=-1)


def test_decode_steps_know_when_the_batch_is_only_draining(llama):
    """While a prompt waits for a slot the batch is refilled (every row's tokens count alike); once
    none waits it only drains, and the budget weighs rows by what they have left."""
    eng = Engine(llama, None, SpecConfig(method="logitspec", max_batch_size=2))
    seen, draft = [], eng.policy.draft

    def spy(rows, draining=False):
        seen.append((len(rows), draining))
        return draft(rows, draining)

    eng.policy.draft = spy
    session = eng.open(Request(max_new_tokens=6))
    for p in repetitive_prompts(3, seed=2):
        session.submit(p)
    session.drain()
    assert seen[0] == (2, False)  # the third prompt waits for a slot
    assert seen[-1][1] is True and all(d for n, d in seen if n == 1)


# ---------------------------------------------------------------- prefill interleaved with decoding
def test_long_prefill_is_interleaved_with_decoding():
    model = tiny_model("gemma3")  # sliding window 6: the window wraps inside every chunk
    short = repetitive_prompts(1, seed=3)[0]
    long_prompt = (repetitive_prompts(2, seed=8)[1] * 10)[:70]
    prompts = [short, long_prompt]
    refs = [hf_greedy(model, p, 40) for p in prompts]
    eng = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=2, budget="fixed"),
                 prefill_chunk=8, fill_chunk=8)
    log = _spy(eng)
    session = eng.open(Request(max_new_tokens=40))
    session.submit(short)
    done = session.step() + session.step()  # the short row is decoding when the long prompt arrives
    session.submit(long_prompt)
    done += session.drain()
    assert [r.token_ids for r in sorted(done, key=lambda r: r.request_id)] == refs
    assert log[0] == ("G", [len(short)])  # a short prompt: prefilled as a group of one
    chunks = [i for i, (kind, n) in enumerate(log) if kind == "P"]  # the long prompt's 9 chunks, alone
    assert len(chunks) == 9
    assert all(log[i + 1][0] == "D" for i in chunks[:-1])  # a decoding step after every chunk
    mark = len(log)
    run = eng.run(prompts, max_new_tokens=40)
    assert [r.token_ids for r in run.results] == refs
    assert [kind for kind, _ in log[mark:]].index("D") == 10  # from empty: the batch fills before decoding
    assert run.stats["max_step_gap_s"] > 0
    assert all("max_step_gap_s" in r.stats for r in run.results)


def test_an_idle_batch_fills_with_bigger_prefill_forwards():
    """While no row decodes, short prompts go several to a forward up to ``fill_chunk`` tokens (not
    ``prefill_chunk``), with the same outputs."""
    model = tiny_model("gemma3")
    prompts = repetitive_prompts(3, seed=4)
    refs = [hf_greedy(model, p, 12) for p in prompts]
    assert [len(p) for p in prompts] == [5, 9, 14]
    for fill, prefills in ((None, [("G", [5, 9, 14])]), (8, [("G", [5]), ("P", 8), ("P", 1), ("P", 8),
                                                             ("P", 6)])):
        eng = Engine(model, None, SpecConfig(method="ar", max_batch_size=3), prefill_chunk=8, fill_chunk=fill)
        log = _spy(eng)
        run = eng.run(prompts, max_new_tokens=12)
        assert [r.token_ids for r in run.results] == refs
        assert log[:log.index(next(e for e in log if e[0] == "D"))] == prefills


# ---------------------------------------------------------------- prefix cache
def _cache_filled_by_ar(model, prompts, refs, block: int):
    """A prefix cache filled by an ``ar`` engine's greedy run of ``prompts`` (checked against
    ``refs``), and a spied ``logitspec`` engine sharing it (``prefill_chunk`` = ``block``)."""
    cache = PrefixCache(max_bytes=1 << 24, block=block)
    first = Engine(model, None, SpecConfig(method="ar", max_batch_size=2), prefix_cache=cache,
                   prefill_chunk=block)
    assert [r.token_ids for r in first.generate(prompts, max_new_tokens=N_NEW)] == refs
    second = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=2, budget="fixed"),
                    prefix_cache=cache, prefill_chunk=block)
    return cache, second, _spy(second)


def test_prefix_cache_shared_by_engines_is_exact_and_counted():
    model = tiny_model("gemma3")
    prompts = repetitive_prompts(4, seed=9)
    refs = [hf_greedy(model, p, N_NEW) for p in prompts]
    cache, second, log = _cache_filled_by_ar(model, prompts, refs, block=8)
    run = second.run(prompts, max_new_tokens=N_NEW)
    assert [r.token_ids for r in run.results] == refs
    assert log and all(kind == "D" for kind, _ in log)  # nothing prefilled again
    assert run.stats["prefix_hits"] == 4 and run.stats["prefix_misses"] == 4
    assert run.stats["prefix_hit_rate"] == 0.5
    assert all(r.stats["cached_prompt_tokens"] == len(p) for r, p in zip(run.results, prompts))
    with pytest.raises(ValueError, match="another model"):
        Engine(tiny_model("gemma3"), None, SpecConfig(method="ar"), prefix_cache=cache)


def test_prefix_cache_reuses_a_block_prefix_and_evicts_by_bytes():
    model = tiny_model("gemma3")
    base = repetitive_prompts(1, seed=10, lengths=(30,))[0]
    other = base[:20] + [(t + 1) % 90 for t in base[20:27]]  # shares 2 blocks of 8 with ``base``
    refs = [hf_greedy(model, p, N_NEW) for p in (base, other)]
    cache = PrefixCache(max_bytes=1 << 24, block=8)
    eng = Engine(model, None, SpecConfig(method="logitspec", budget="fixed"), prefix_cache=cache,
                 prefill_chunk=8)
    if eng.runner.head.screen is not None:  # one pass for one-row outputs from now on: every entry's
        eng.runner.head.screen.settle(1)    # scores of one dtype (the bfloat16 pass keeps bfloat16), one size
    assert eng.generate([base], max_new_tokens=N_NEW)[0].token_ids == refs[0]
    log = _spy(eng)
    res = eng.generate([other], max_new_tokens=N_NEW)[0]
    assert res.token_ids == refs[1]
    assert [n for kind, n in log if kind == "P"] == [8, 3]  # only what follows the 16 cached tokens
    assert res.stats["cached_prompt_tokens"] == 16 and cache.stats["partial_hits"] == 1
    one_entry = cache.stats["bytes"] - 1  # room for either entry, not both
    small = PrefixCache(max_bytes=one_entry, block=8)
    eng = Engine(model, None, SpecConfig(method="ar"), prefix_cache=small, prefill_chunk=8)
    eng.generate([base, other, base], max_new_tokens=2)
    assert small.stats["entries"] == 1 and small.stats["bytes"] <= one_entry
    assert small.stats["hits"] == 0  # ``base`` was evicted by ``other``


# ---------------------------------------------------------------- short prompts prefilled together
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_short_prompts_are_prefilled_together_and_exact(family):
    model = tiny_model(family)  # gemma3: sliding window 6, shorter than most prompts
    prompts = repetitive_prompts(7, seed=12, lengths=(5, 9, 14, 20))
    refs = [hf_greedy(model, p, N_NEW) for p in prompts]
    eng = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=4, budget="fixed"),
                 prefill_chunk=8,
                 # most prompts longer than a chunk: still grouped while rows decode, up to fill_chunk
                 fill_chunk=48)
    log = _spy(eng)
    assert [r.token_ids for r in eng.generate(prompts, max_new_tokens=N_NEW)] == refs
    groups = [n for kind, n in log if kind == "G"]
    assert max(len(n) for n in groups) > 1 and not any(kind == "P" for kind, _ in log)
    assert all(sum(n) <= eng.fill_chunk for n in groups)  # back to back, unpadded: within one fill chunk
    first_step = [kind for kind, _ in log].index("D")
    # refills while decoding
    assert any(kind == "G" and sum(n) > eng.prefill_chunk for kind, n in log[first_step:])
    # some group mixed lengths (no padding to test otherwise)
    assert any(sum(n) > len(n) * min(n) for n in groups)
    assert sorted(x for n in groups for x in n) == sorted(len(p) for p in prompts)  # each prefilled once


def test_short_prompts_whole_in_the_prefix_cache_are_admitted_without_a_forward():
    model = tiny_model("llama")
    prompts = repetitive_prompts(5, seed=13, lengths=(5, 9, 14))
    refs = [hf_greedy(model, p, N_NEW) for p in prompts]
    _, second, log = _cache_filled_by_ar(model, prompts, refs, block=64)
    run = second.run(prompts + prompts[:1], max_new_tokens=N_NEW)
    assert [r.token_ids for r in run.results] == refs + refs[:1]
    assert log and all(kind == "D" for kind, _ in log)  # every prompt came whole from the cache


def test_a_rows_drafted_rate_counts_only_its_steps_that_verified_drafts():
    """The drain rule's estimate of a row's steps left: tokens per step when it drafts, so a row the
    budget stopped drafting for does not look slower than it is (its plain steps left out)."""
    seq = DecodingSequence.start((0, 0), [1, 2, 3], 64, SamplingParams(), 0, [], [], 4, 1)
    assert seq.drafted_rate == 1.0  # nothing drafted yet
    seq.stats.add_step(1, retrieved=False)  # the prefill's token
    for emitted, size in [(4, 6), (1, 0), (1, 0), (3, 5), (1, 0)]:
        seq.stats.add_step(emitted, retrieved=size > 0, tree_size=size)
    assert seq.drafted_rate == 3.5
    for _ in range(RATE_STEPS):
        seq.stats.add_step(2, retrieved=True, tree_size=1)
    assert seq.drafted_rate == 2.0  # the last RATE_STEPS drafting steps only

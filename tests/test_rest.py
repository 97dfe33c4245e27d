"""REST: the datastore's suffix-array lookups and the trie, on hand-made integer tables; the drafter;
lossless greedy and sampled decoding on the tiny families."""
import numpy as np
import pytest

from logitspec.config import SpecConfig
from logitspec.spec_decode import rest
from logitspec.spec_decode.drafters import RestDrafter, make_drafter
from logitspec.spec_decode.ngram_index import SequenceIndex
from logitspec.spec_decode.rest import Datastore, suffix_array
from logitspec.spec_decode.rest_trie import context_matches, gather, select_trie
from logitspec.spec_decode.tree import GUESS


def _naive_sa(tokens):
    return sorted(range(len(tokens)), key=lambda i: list(tokens[i:]))


@pytest.mark.parametrize("seed", range(5))
def test_suffix_array_equals_sorting_the_suffixes(seed):
    rng = np.random.default_rng(seed)
    toks = rng.integers(-1, 4, size=int(rng.integers(1, 200)))  # small alphabet: long repeats
    assert suffix_array(toks).tolist() == _naive_sa(toks.tolist())
    # truncated at depth 8: ordered by the first 8 tokens, ties by position
    d8 = suffix_array(toks, depth=8).tolist()
    assert d8 == sorted(range(len(toks)), key=lambda i: (toks[i:i + 8].tolist(), i))


def test_datastore_ranges_continuations_and_document_boundaries():
    ds = Datastore.build([[1, 2, 3, 4, 5], [9, 2, 3, 7], [2, 3]])
    lo, hi = ds.match_range([2, 3])
    assert hi - lo == 3  # three occurrences, one at a document's end
    conts = ds.continuations([2, 3], 3)
    assert conts.tolist() == [[4, 5, -1], [7, -1, -1]]  # sorted; the document-final one has none
    lo, hi = ds.match_range([3, 9])
    assert lo == hi  # never across documents
    assert ds.continuations([3, 9], 3).shape == (0, 3)
    assert ds.lookup([2, 3], 2, max_results=5) == [[4, 5], [7]]
    assert ds.lookup([8], 2) == []


def test_longest_suffix_match_is_the_longest_found():
    ds = Datastore.build([[5, 1, 2, 3, 4, 6], [7, 2, 3, 8]])
    assert ds.longest_match([9, 1, 2, 3]) == 3  # (1, 2, 3) occurs; (9, 1, 2, 3) does not
    assert ds.longest_match([7, 2, 3]) == 3
    assert ds.longest_match([0, 0, 3]) == 0  # min span 2: (0, 3) does not occur
    assert ds.longest_match([0, 0, 3], min_span=1) == 1
    assert ds.longest_match([5, 1, 2, 3], max_span=2) == 2


def test_retrieve_longest_match_first_and_its_occurrences():
    # (1, 2, 3) occurs twice -> continuations 4 6 and 4 9; the shorter (2, 3) also before 8: not used
    ds = Datastore.build([[1, 2, 3, 4, 6], [1, 2, 3, 4, 9], [2, 3, 8]])
    toks, parents, depths, span = rest.retrieve(ds, [0, 1, 2, 3], n_nodes=10, continuation=2)
    assert span == 3
    assert toks.tolist() == [4, 6, 9] and parents.tolist() == [-1, 0, 0] and depths.tolist() == [1, 2, 2]
    # no match at all: empty draft
    toks, _, _, span = rest.retrieve(ds, [7, 7, 7], n_nodes=10)
    assert len(toks) == 0 and span == 0


def test_retrieve_falls_back_to_a_shorter_suffix_whose_continuation_is_not_empty():
    ds = Datastore.build([[1, 2, 3], [2, 3, 5]])  # (1, 2, 3) ends a document: nothing after it
    toks, _, _, span = rest.retrieve(ds, [1, 2, 3], n_nodes=4)
    assert span == 2 and toks.tolist() == [5]


def test_trie_merges_shared_prefixes_and_keeps_the_most_frequent_nodes():
    conts = np.array([[4, 5, 6], [4, 5, 7], [4, 8, -1], [9, -1, -1]])
    toks, parents, depths = select_trie(conts, 10)
    # weights: 4:3, 4-5:2, 9:1, 4-8:1, 4-5-6:1, 4-5-7:1 (ties: shallower, then lexicographic)
    assert toks.tolist() == [4, 5, 9, 8, 6, 7]
    assert parents.tolist() == [-1, 0, -1, 0, 1, 1]
    assert depths.tolist() == [1, 2, 1, 2, 3, 3]
    # the budget cap keeps the heaviest, ancestors first
    toks, parents, _ = select_trie(conts, 3)
    assert toks.tolist() == [4, 5, 9] and parents.tolist() == [-1, 0, -1]
    assert len(select_trie(conts, 0)[0]) == 0


def test_trie_of_random_continuations_is_a_tree_of_the_heaviest_prefixes():
    rng = np.random.default_rng(0)
    conts = rng.integers(0, 3, size=(200, 5))
    conts[rng.random(200) < 0.3, 3:] = -1
    toks, parents, depths = select_trie(conts, 20)
    counts = {}
    for row in conts.tolist():
        for d in range(1, 6):
            if row[d - 1] < 0:
                break
            counts[tuple(row[:d])] = counts.get(tuple(row[:d]), 0) + 1
    paths = []
    for i, (t, p) in enumerate(zip(toks.tolist(), parents.tolist())):
        assert p < i
        paths.append((paths[p] if p >= 0 else ()) + (t,))
        assert len(paths[-1]) == depths[i]
    assert len(set(paths)) == 20
    got = sorted(counts[p] for p in paths)
    assert got == sorted(counts.values())[-20:]  # the 20 heaviest weights


def test_context_matches_longest_suffix_and_all_its_occurrences():
    ctx = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]
    span, starts = context_matches(ctx, max_span=16, min_span=2)
    assert span == 3 and starts.tolist() == [3]  # (1, 2, 3) once before the end, followed by 9
    span, starts = context_matches(ctx, max_span=2, min_span=2)
    assert span == 2 and starts.tolist() == [3, 6]
    assert context_matches([1, 2, 3], 16, 2)[0] == 0
    assert gather(np.array(ctx), starts, 3).tolist() == [[9, 2, 3], [7, 1, 2]]


def test_drafter_uses_the_datastore_among_the_sources():
    ds = Datastore.build([[1, 2, 3, 4, 6], [1, 2, 3, 4, 9]])
    ctx = [5, 1, 2, 3]
    d = make_drafter(SpecConfig(method="rest"))
    assert isinstance(d, RestDrafter) and not d.wants_guesses and d.base_budget() == 32  # the capacity
    t = d.draft([SequenceIndex(ctx), ds], ctx, [], budget=10)
    assert t.tokens.tolist() == [3, 4, 6, 9] and t.parents.tolist() == [-1, 0, 1, 1] and t.retrieved
    assert t.origins.tolist() == [GUESS, 1, 1, 1] and t.offsets.tolist() == [0, 0, 1, 1]
    assert len(d.draft([SequenceIndex(ctx), ds], ctx, [], budget=2)) == 3  # the budget caps the nodes
    small = make_drafter(SpecConfig(method="rest", rest_num_draft=1))
    assert len(small.draft([SequenceIndex(ctx), ds], ctx, [], budget=10)) == 2
    # no datastore: the row's own context
    ctx2 = [1, 2, 3, 4, 1, 2]
    t = d.draft([SequenceIndex(ctx2)], ctx2, [], budget=10)
    assert t.tokens.tolist()[:3] == [2, 3, 4] and t.origins.tolist()[1] == 0
    none = d.draft([SequenceIndex([7, 8])], [7, 8], [], budget=10)
    assert none.tokens.tolist() == [8] and not none.retrieved


def test_save_load_and_arrays_round_trip(tmp_path):
    ds = Datastore.build([[1, 2, 3, 4], [2, 3, 5]])
    size = ds.save(tmp_path / "ds")
    assert size > ds.nbytes
    again = Datastore.load(tmp_path / "ds")
    assert again.tokens.tolist() == ds.tokens.tolist() and again.suffixes.tolist() == ds.suffixes.tolist()
    assert again.lookup([2, 3], 2, 3) == ds.lookup([2, 3], 2, 3)
    arrays = ds.to_arrays()
    assert Datastore.holds(arrays) and Datastore.from_arrays(arrays).longest_match([9, 2, 3]) == 2
    with pytest.raises(FileNotFoundError):
        Datastore.load(tmp_path / "nothing")


def test_build_datastore_from_texts_with_a_tokenizer():
    class Tok:
        name_or_path = "bytes"

        def __len__(self):
            return 256

        def __call__(self, texts, add_special_tokens=False):
            return type("E", (), {"input_ids": [list(t.encode()) for t in texts]})()

    ds = rest.build_datastore(["def f(x):\n    return x", "def g(y):"], Tok())
    assert ds.meta["documents"] == 2 and ds.meta["tokens"] == 31 and ds.meta["build_s"] >= 0
    assert ds.lookup(list(b"def "), 1, 5) == [[ord("f")], [ord("g")]]


def test_config_validates_rest_fields():
    with pytest.raises(ValueError):
        SpecConfig(method="rest", rest_min_span=3, rest_max_span=2)
    with pytest.raises(ValueError):
        SpecConfig(method="rest", rest_num_draft=0)


# ------------------------------------------------------------------------------ through the engine
from tiny_models import FAMILIES, VOCAB, hf_greedy, repetitive_prompts, tiny_model  # noqa: E402

N_NEW = 24


@pytest.mark.parametrize("family", FAMILIES)
def test_rest_with_a_datastore_is_lossless_and_drafts_from_it(family):
    """A datastore holding the greedy answers of other prompts and of these (so long matches occur,
    and continuations that part from the answer too): greedy output == plain greedy, batched too."""
    from logitspec import Engine

    model = tiny_model(family)
    prompts = repetitive_prompts(6, seed=4)
    refs = [hf_greedy(model, p, N_NEW) for p in prompts]
    rng = np.random.default_rng(0)
    docs = [p + r for p, r in zip(prompts, refs)] + [rng.integers(0, VOCAB, 40).tolist() for _ in range(20)]
    docs += [p + r[:8] + rng.integers(0, VOCAB, 8).tolist() for p, r in zip(prompts, refs)]  # wrong branches
    store = Datastore.build(docs)
    for batch in (1, 3):
        eng = Engine(model, None, SpecConfig(method="rest", max_batch_size=batch, budget="fixed"))
        res = eng.generate(prompts, max_new_tokens=N_NEW, reference=store)
        assert [r.token_ids for r in res] == refs
    assert max(r.stats["mean_accepted"] for r in res) > 3  # the answers are in the datastore
    assert any(r.stats["accepted_from"].get("reference", 0) > 0 for r in res)


def test_rest_sampling_emits_the_target_distribution():
    """Chi-square of the first three sampled tokens against the exact distribution, with a datastore
    that drafts the target's likely next tokens (so the walk follows drafts)."""
    import torch
    from chi2 import chi2, chi2_limit

    from logitspec import Engine
    from logitspec.sample.params import SamplingParams
    from logitspec.sample.sampler import probs_from_logits
    from logitspec.worker.head import ScreenedArgmax

    if not ScreenedArgmax.supported(torch.zeros(1, 1)):
        pytest.skip("no float16 kernels")
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    prompt = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:12].tolist()
    params = SamplingParams(0.8, top_p=0.95)
    with torch.no_grad():
        nxt = model(torch.tensor([prompt + [t] for t in range(VOCAB)])).logits[:, -1].argmax(-1)
    store = Datastore.build([prompt[-2:] + [t, int(nxt[t])] for t in range(VOCAB)])
    cells, rest_mass = {(): 1.0}, 0.0  # exact probabilities of the first 3 tokens (cells >= 1e-4)
    for _ in range(3):
        seqs = list(cells)
        with torch.no_grad():
            probs = probs_from_logits(model(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1],
                                      params).double()
        grown = {}
        for s, row in zip(seqs, probs):
            joint = cells[s] * row
            keep = joint >= 1e-4
            rest_mass += float(joint[~keep].sum())
            grown.update({s + (int(t),): float(joint[t]) for t in torch.nonzero(keep).squeeze(1)})
        cells = grown
    cells[()] = rest_mass
    n = 800
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(model, None, SpecConfig(method="rest", max_batch_size=16, budget="fixed"))
        res = engine.generate([prompt] * n, max_new_tokens=3, temperature=params.temperature,
                              top_p=params.top_p, seed=list(range(1000, 1000 + n)), reference=store)
    finally:
        torch.set_num_threads(before)
    keys = list(cells)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.bincount([index.get(tuple(r.token_ids), index[()]) for r in res], minlength=len(keys))
    stat, df = chi2(counts, np.array([cells[k] for k in keys]), n)
    assert stat < chi2_limit(df), (stat, df)
    assert sum(r.stats["accepted_lengths"][1] > 1 for r in res) > n // 10  # the walk followed drafts


def test_bench_runs_rest_with_and_without_a_datastore(tmp_path):
    """``rest`` (the context as datastore) and ``rest@datastore=DIR`` rows in ``logitspec bench``: lossless,
    and the datastore recorded in the method's configuration."""
    import torch
    from test_bench import _tiny_model, _tiny_questions

    from logitspec.bench import bench, parse_methods

    assert "rest" in [s.name for s in parse_methods("ar,rest")]
    qs = _tiny_questions()
    Datastore.build([list(t) for q in qs for t in q.turns]).save(tmp_path / "ds")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = bench((_tiny_model(), None), qs, tmp_path / "out",
                        methods=f"rest@budget=fixed,rest@budget=fixed@datastore={tmp_path / 'ds'}",
                        max_new_tokens=8, warmup_tokens=4, progress=False)
    finally:
        torch.set_num_threads(before)
    plain, named = "rest@budget=fixed", f"rest@budget=fixed@datastore={tmp_path / 'ds'}"
    assert summary["methods"][plain]["lossless"] == 1.0 and summary["methods"][named]["lossless"] == 1.0
    assert summary["method_configs"][named]["datastore"]["documents"] == 4
    assert "datastore" not in summary["method_configs"][plain]

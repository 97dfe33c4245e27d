"""Greedy decoding through a graph runner's static path alone (no session, no policy): the tests' and the
device check's plain reference for the slots, the buckets and the commit."""
from __future__ import annotations

from logitspec.sample.acceptance import greedy_accept
from logitspec.spec_decode.tree import DraftTree
from logitspec.worker.gpu.graph_runner import GraphRunner
from logitspec.worker.head import OutputMode
from logitspec.worker.masks import StepRow


def greedy_chains(runner: GraphRunner, prompts: list[list[int]], new_tokens: int, chunk: int = 512,
                  tree=None) -> list[list[int]]:
    """Greedy decoding of ``prompts`` side by side through ``runner``'s static path (prefill into the
    slots, then steps of all rows): ``new_tokens`` each. ``tree(b, root, step)``: a
    :class:`~logitspec.spec_decode.tree.DraftTree` rooted at ``root`` to verify for row b (default: the root
    alone, plain decoding); the accepted path is committed on the device."""
    kv = runner.new_batch()
    out = [[int(runner.prefill_slot(p, chunk).argmax[0])] for p in prompts]
    step = 0
    while min(len(o) for o in out) < new_tokens:
        trees = [tree(b, o[-1], step) if tree else DraftTree.single(o[-1]) for b, o in enumerate(out)]
        rows = [StepRow.from_tree(kv.lengths[b], t) for b, t in enumerate(trees)]
        fwd = runner.step(rows, kv, OutputMode.EXACT)
        paths = []
        for b, (t, lg) in enumerate(zip(trees, fwd.logits)):
            path, bonus = greedy_accept(t, lg.argmax.tolist())
            out[b] += [int(t.tokens[n]) for n in path[1:]] + [bonus]
            paths.append(path)
        kv.commit_paths(paths)
        step += 1
    return [o[:new_tokens] for o in out]

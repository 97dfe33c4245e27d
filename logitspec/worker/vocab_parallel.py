"""The output layer split by vocabulary over a tensor-parallel group: rank r holds rows ``[r S, (r+1) S)``
of the output weight (``S = ceil(V / world)``), so a greedy step needs no rank to hold a whole row of
logits.

DeepSpeed AutoTP splits the output layer along the hidden size instead and all-reduces ``[N, V]``
partial logits every step (2 (w-1)/w N V values through every rank). Split by vocabulary:

* the argmax is each rank's own (value, token) and one gather of ``[w, N, 2]``;
* the top k tokens are each rank's own top k and one gather of ``[w, N, k, 2]``;
* full logits (sampling, the model's own forward) are one gather of ``[w, N, S]``, half the
  all-reduce's traffic.

Every rank gathers the same values and decides alike. Ties go to the lowest token id, as
``torch.argmax`` breaks them on one device. A shard's rows past ``V`` (the last rank's padding) score
``-inf``. Fixed shapes, no host read: a CUDA graph can hold it with its collectives.
"""
from __future__ import annotations

import torch

# torch >= 2.13 names it all_gather_single (all_gather_into_tensor: deprecated there, the name before)
_all_gather_into = (getattr(torch.distributed, "all_gather_single", None)
                    or torch.distributed.all_gather_into_tensor)


class VocabParallelHead(torch.nn.Module):
    """Rank ``rank`` of ``world``'s rows of an output weight ``[V, H]`` (copied; no bias)."""

    def __init__(self, weight: torch.Tensor, rank: int, world: int, group=None):
        super().__init__()
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a group of {world}")
        vocab, hidden = weight.shape
        self.vocab_size, self.world, self.rank, self.group = int(vocab), world, rank, group
        self.shard = -(-self.vocab_size // world)  # S rows a rank
        start = rank * self.shard
        rows = weight.detach()[start:start + self.shard]
        padded = torch.zeros(self.shard, hidden, dtype=weight.dtype, device=weight.device)  # [S, H]
        padded[:len(rows)] = rows
        self.weight = torch.nn.Parameter(padded, requires_grad=False)
        # [S] bool: the shard's rows past the vocabulary (masked to -inf, on the device: no host read)
        self.register_buffer("padding", torch.arange(start, start + self.shard) >= self.vocab_size,
                             persistent=False)
        self.register_buffer("offset", torch.tensor(start, dtype=torch.int64), persistent=False)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: every rank's ``x`` (rank order), gathered into one tensor (the form NCCL
        captures without a staging copy per rank, as Megatron and vLLM gather)."""
        out = torch.empty((self.world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_into(out, x.contiguous(), group=self.group)
        return out.view((self.world,) + tuple(x.shape))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Full logits ``[..., V]`` of ``h`` ``[..., H]`` (as the output ``Linear``: no soft cap)."""
        local = h @ self.weight.T  # [..., S]
        whole = self._gather(local)  # [world, ..., S]
        return whole.movedim(0, -2).flatten(-2)[..., :self.vocab_size]

    def shard_logits(self, h: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        """``[N, S]`` float32: this rank's logits of ``h`` ``[N, H]`` (soft-capped where the model caps
        them), padding rows at -inf."""
        w = self.weight
        if h.device.type == "cpu" and h.dtype == torch.bfloat16:  # as Head.output on CPU: float32 products
            h, w = h.float(), w.float()  # of the widened weights (the same bits in any batch)
        local = h @ w.T  # in the model's dtype, capped in it too: as one device computes them
        if softcap:
            local = torch.tanh(local / softcap) * softcap
        return local.float().masked_fill(self.padding, float("-inf"))

    def top(self, h: torch.Tensor, k: int, softcap: float | None = None) -> torch.Tensor:
        """``[N, k]`` int64: the ``k`` best tokens of ``h`` ``[N, H]`` over the whole vocabulary, best
        first; ``k = 1`` is the argmax, ties to the lowest token id."""
        local = self.shard_logits(h, softcap)  # [N, S]
        if k == 1:  # argmax's rule for ties: the first (lowest) index
            idx = local.argmax(-1, keepdim=True)  # [N, 1]
            val = local.gather(-1, idx)
        else:
            val, idx = torch.topk(local, min(k, self.shard), dim=-1)  # [N, k']
        # values (float32) and global ids (< 2^53) both exact in float64: one collective
        pairs = torch.stack([val.double(), (idx + self.offset).double()], dim=-1)  # [N, k', 2]
        every = self._gather(pairs)  # [world, N, k', 2]
        vals = every[..., 0].movedim(0, 1).flatten(1)  # [N, world * k']: rank order = token order
        ids = every[..., 1].movedim(0, 1).flatten(1).long()
        if k == 1:  # the first maximal rank holds the lowest maximal id
            return ids.gather(1, vals.argmax(-1, keepdim=True))
        return ids.gather(1, torch.topk(vals, k, dim=-1).indices)

    def argmax(self, h: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        """``[N]`` int64: the argmax token of ``h`` ``[N, H]``, ties to the lowest token id."""
        return self.top(h, 1, softcap)[:, 0]


def install(model, rank: int, world: int, group=None):
    """A :class:`VocabParallelHead` of ``model``'s output weight for this rank, made before AutoTP shards
    the model (it needs the whole weight); None where the output layer has a bias or is missing.
    ``attach`` it once the model is sharded."""
    out = model.get_output_embeddings()
    if out is None or getattr(out, "bias", None) is not None:
        return None
    return VocabParallelHead(out.weight, rank, world, group)


def attach(model, head: VocabParallelHead) -> None:
    """Make ``head`` (on the model's device) ``model``'s output layer, in place of AutoTP's
    hidden-split one, which is freed."""
    device = next(model.get_decoder().parameters()).device
    model.set_output_embeddings(head.to(device))

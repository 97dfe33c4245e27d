"""Static KV storage: a fixed number of slots of a fixed length, written in place.

One tensor holds every layer's keys, another every layer's values:
``[layers, slots, kv_heads, max_len, head_dim]``, allocated once (at the first write). Row b of a
step is slot b: rows are kept compact (a finished row's slot is refilled by moving the last row
into it, as :meth:`~logitspec.worker.kv_cache.BatchKV.keep_rows` does), so a step over R rows attends over
the view ``K[layer, :R]`` and no layer gathers its rows. Column = position: row b's committed
tokens are columns ``[0, lengths[b])``; a step writes its T nodes (pads included) at columns
``lengths[b] + i`` and the commit moves the accepted ones to ``lengths[b] + depth``.

As in :mod:`logitspec.worker.kv_cache`, every layer keeps every column: sliding windows are enforced by the
masks, never by eviction, so rejected nodes never evict valid columns (docs/engine.md, on Gemma 3).

The cache handed to the model is a ``transformers.Cache`` of :class:`SlotLayer` (a
``DynamicLayer`` subclass through the public layer extension point); what a layer's ``update``
writes and returns is set per forward by the owning :class:`SlotKV` (:meth:`SlotKV.for_prefill`,
:meth:`SlotKV.for_step`), host-side state only, so a captured step's writes replay unchanged.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from logitspec.device import to_device


class SlotLayer(DynamicLayer):
    """One layer's view of the slot storage of its :class:`SlotKV`."""

    def __init__(self, owner: "SlotKV", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        # initialized from the start: a step compiled before its first write would otherwise be
        # compiled again after it (its guards read this flag)
        self.device, self.is_initialized = owner.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``key_states``/``value_states`` [rows, heads, T, dim] where the owner's mode says;
        the keys and values attention reads (views of the storage)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner.write(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return max(self.owner.lengths, default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.key_len, 0

    def get_max_length(self) -> int:
        return self.owner.max_len

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("slot storage is rolled back by SlotKV.truncate")


class SlotKV:
    """Rows of committed KV entries in fixed slots; ``lengths[b]`` columns of row (= slot) b are
    valid. The interface :class:`~logitspec.worker.kv_cache.BatchKV` gives the engine and the session
    (``lengths``, ``rows``, ``columns``, ``commit``, ``keep_rows``, ``add_rows``, ``truncate``),
    over storage that never grows."""

    def __init__(self, layers: int, slots: int, max_len: int, device: torch.device | str = "cpu"):
        self.n_layers, self.slots, self.max_len = layers, slots, max_len
        self.device = torch.device(device)
        self.hf = Cache(layers=[SlotLayer(self, i) for i in range(layers)])
        self.lengths: list[int] = []
        self.K: torch.Tensor | None = None  # [layers, slots, kv_heads, max_len, head_dim]
        self.V: torch.Tensor | None = None
        self.allocations = 0  # storage allocations (one, unless reset)
        self.key_len = 0  # columns a layer hands to attention in the current mode
        self._mode: tuple = ("none",)

    # ------------------------------------------------------------------ storage
    def allocate(self, heads: int, head_dim: int, dtype: torch.dtype, v_head_dim: int | None = None) -> None:
        """Allocate the storage now (it is otherwise allocated at the first write)."""
        if self.K is not None:
            return
        shape = (self.n_layers, self.slots, heads, self.max_len, head_dim)
        self.K = torch.zeros(shape, dtype=dtype, device=self.device)
        self.V = torch.zeros(shape[:-1] + (v_head_dim or head_dim,), dtype=dtype, device=self.device)
        # one view per layer, made once: a compiled step writes these in place (inductor reinplaces an
        # index_put_ on a view it is handed; indexing the 5-D storage inside the step, or a scatter_,
        # makes it copy the layer's slots on every write)
        self.layer_views = [(self.K[i], self.V[i]) for i in range(self.n_layers)]
        self.allocations += 1

    @property
    def bytes(self) -> int:
        return 0 if self.K is None else self.K.nbytes + self.V.nbytes

    # ------------------------------------------------------------------ modes (set before a forward)
    def for_prefill(self, slot: int, start: int, tokens: int) -> None:
        """The next forward writes ``tokens`` columns of row ``slot`` from column ``start`` on, and
        its layers read that row's columns ``[0, start + tokens)``."""
        if start + tokens > self.max_len:
            raise ValueError(f"row {slot}: {start + tokens} columns exceed the slot length {self.max_len}")
        self._mode = ("prefill", slot, start)
        self.key_len = start + tokens

    def for_step(self, rows: int, write_cols: torch.Tensor, key_len: int) -> None:
        """The next forward writes node i of row b at column ``write_cols[b, i]`` ([R, T] int64, a
        device buffer) of slot b < ``rows``, and its layers read columns ``[0, key_len)`` of slots
        ``[0, rows)``."""
        slot = torch.arange(rows, device=write_cols.device)[:, None]  # [R, 1]
        self._mode = ("step", rows, write_cols, slot)
        self.key_len = key_len

    def end_step(self) -> None:
        """No write mode until the next :meth:`for_prefill` / :meth:`for_step`."""
        self._mode = ("none",)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.K is None:
            self.allocate(k.shape[1], k.shape[3], k.dtype, v.shape[3])
        if k.shape[1] != self.K.shape[2] or k.shape[3] != self.K.shape[4] or k.dtype != self.K.dtype:
            raise ValueError(f"layer {layer}: keys {tuple(k.shape)} {k.dtype} do not fit the slot storage "
                             f"{tuple(self.K.shape)} {self.K.dtype} (layers of other shapes: unsupported)")
        K, V = self.layer_views[layer]  # [slots, heads, max_len, dim]
        kind = self._mode[0]
        if kind == "prefill":
            _, slot, start = self._mode
            T = k.shape[2]
            K[slot, :, start:start + T] = k[0]
            V[slot, :, start:start + T] = v[0]
            return K[slot:slot + 1, :, :start + T], V[slot:slot + 1, :, :start + T]
        if kind == "step":
            _, rows, cols, slot = self._mode
            # index_put_ on dims 0 and 2 ([R, T] each): values [R, T, heads, dim]
            K[slot, :, cols] = k.transpose(1, 2)
            V[slot, :, cols] = v.transpose(1, 2)
            return K[:rows, :, :self.key_len], V[:rows, :, :self.key_len]
        raise RuntimeError("SlotKV: no write mode set (for_prefill / for_step) before the forward")

    # ------------------------------------------------------------------ BatchKV's interface
    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        """The longest row's committed columns (a step's node i of row b sits at ``lengths[b] + i``;
        :meth:`commit` takes ``columns + i``, as the engine passes it)."""
        return max(self.lengths, default=0)

    def reset(self) -> None:
        """No rows (the storage stays)."""
        self.lengths = []

    def commit(self, src_cols: list[list[int]]) -> None:
        """:meth:`BatchKV.commit`'s convention: after a step, keep for row b the nodes at columns
        ``src_cols[b]`` (``columns + node index``, ascending)."""
        base = self.columns
        self.commit_paths([[c - base for c in cols] for cols in src_cols])

    def commit_paths(self, paths: list[list[int]]) -> None:
        """After a step, row b keeps its nodes ``paths[b]`` (ascending node indices, root first):
        node ``paths[b][d]`` moves from column ``lengths[b] + paths[b][d]`` to ``lengths[b] + d``.
        On the device: one gather and one scatter over all layers' keys and one of their values."""
        if len(paths) != self.rows:
            raise ValueError(f"{len(paths)} paths for {self.rows} rows")
        moving = [b for b, p in enumerate(paths) if any(n != d for d, n in enumerate(p))]
        if moving and self.K is not None:
            depth = max(len(paths[b]) for b in moving)
            host = np.zeros((3, len(moving), depth), dtype=np.int64)  # slot, src column, dst column
            for j, b in enumerate(moving):
                p = list(paths[b]) + list(range(len(paths[b]), depth))  # beyond the path: nothing moves
                host[0, j] = b
                host[1, j] = self.lengths[b] + np.asarray(p)
                host[2, j] = self.lengths[b] + np.arange(depth)
            if host[1].max() >= self.max_len:
                raise ValueError("commit past the slot length")
            idx = to_device(host, self.K.device)  # [3, M, depth]
            slot = idx[0]  # [M, depth]
            for buf in (self.K, self.V):  # [layers, slots, heads, max_len, dim]
                # advanced indices on dims 1 and 3: [M, depth, layers, heads, dim], gathered before written
                buf[:, slot, :, idx[2]] = buf[:, slot, :, idx[1]]
        for b, p in enumerate(paths):
            self.lengths[b] += len(p)

    def truncate(self, lengths: list[int]) -> None:
        """Row b keeps its first ``lengths[b]`` committed columns."""
        if len(lengths) != self.rows or any(n > m for n, m in zip(lengths, self.lengths)):
            raise ValueError(f"cannot truncate rows of lengths {self.lengths} to {lengths}")
        self.lengths = list(lengths)

    def keep_rows(self, rows: list[int]) -> list[int]:
        """Release every row not in ``rows``; kept rows past the new row count move into the freed
        slots (one copy of their columns per freed slot). Returns the kept rows' old indices in
        their new order (:meth:`BatchKV.keep_rows`'s contract)."""
        if rows == list(range(self.rows)):
            return list(rows)
        n = len(rows)
        order = list(range(n))  # new row -> old row
        for slot, src in zip(sorted(set(range(n)) - set(rows)), [r for r in rows if r >= n]):
            order[slot] = src
        moves = [(d, s) for d, s in enumerate(order) if d != s]
        if moves and self.K is not None:
            width = max(self.lengths[s] for _, s in moves)
            dst, src = to_device(np.asarray(list(zip(*moves)), dtype=np.int64), self.K.device)  # [2, M]
            for buf in (self.K, self.V):
                buf[:, :, :, :width].index_copy_(1, dst, buf[:, :, :, :width].index_select(1, src))
        self.lengths = [self.lengths[r] for r in order]
        return order

    def add_row(self, other, copies: int = 1, take: bool = False) -> None:
        """Append ``copies`` copies of the single row of ``other`` (a prefilled BatchKV)."""
        self.add_rows([(other, 0, copies)])

    def add_rows(self, sources) -> None:
        """Append, in order, ``copies`` copies of row ``row`` of ``cache`` (a
        :class:`~logitspec.worker.kv_cache.BatchKV` prefilled by the eager path) for each
        ``(cache, row, copies)``: their committed columns are copied into the next free slots."""
        added = sum(c for _, _, c in sources)
        if self.rows + added > self.slots:
            raise ValueError(f"{self.rows + added} rows exceed the {self.slots} slots")
        for src, r, copies in sources:
            n = src.lengths[r]
            if n > self.max_len:
                raise ValueError(f"a row of {n} columns exceeds the slot length {self.max_len}")
            layers = list(src._layers()) if n else []
            if layers and self.K is None:
                k, v = layers[0].keys, layers[0].values
                self.allocate(k.shape[1], k.shape[3], k.dtype, v.shape[3])
            for _ in range(copies):
                slot = self.rows
                for i, layer in enumerate(layers):
                    self.K[i, slot, :, :n] = layer.keys[r, :, :n]
                    self.V[i, slot, :, :n] = layer.values[r, :, :n]
                self.lengths.append(n)

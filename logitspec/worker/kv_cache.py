"""Batched KV cache: one row per active sequence, rows left-aligned (column = position).

The only module that touches cache tensors. It is a ``transformers.Cache`` of :class:`GrowingLayer`
(a ``DynamicLayer`` that keeps all columns): sliding windows are enforced by the masks
(``masks.py``), never by eviction, which makes rolling back rejected draft nodes safe after the
window has wrapped (docs/engine.md).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from logitspec.device import to_device


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose columns live in a buffer with spare room: a step writes its new
    columns in place instead of concatenating the whole cache (``DynamicLayer.update`` copies every
    cached column on every step; measured in ``git show 4974864:docs/performance.md``). ``keys``/``values``
    are views of the first ``n`` columns. ``start``: the first column :meth:`update` hands to attention
    (set per forward for sliding-window layers, :meth:`BatchKV.attend_from`; the cache itself keeps all)."""

    start = 0
    reserve = 0  # columns to make room for when the buffer grows (a prompt's known length)

    @classmethod
    def reserving(cls, columns: int) -> "GrowingLayer":
        """A layer whose first growth makes room for ``columns`` columns."""
        layer = cls()
        layer.reserve = columns
        return layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.set(key_states[:, :, :0], value_states[:, :, :0])

    def set(self, keys: torch.Tensor, values: torch.Tensor, room: int = 0, row_room: int = 0) -> None:
        """Hold copies of ``keys``/``values`` [rows, heads, n, dim], with ``room`` spare columns
        and ``row_room`` spare rows (:meth:`append_rows` fills them without a copy of the rest)."""
        self.is_initialized = True
        self.n, rows = keys.shape[2], keys.shape[0]
        self._K = keys.new_empty(rows + row_room, keys.shape[1], self.n + room, keys.shape[3])
        self._V = values.new_empty(rows + row_room, values.shape[1], self.n + room, values.shape[3])
        self._k, self._v = self._K[:rows], self._V[:rows]
        self._k[:, :, :self.n] = keys
        self._v[:, :, :self.n] = values
        self._views()

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, n: int, rows: int | None = None) -> None:
        """Take ``keys``/``values`` [row capacity, heads, capacity, dim] as the buffers (no copy);
        the first ``rows`` rows (default all) and ``n`` columns are the cached ones."""
        self.is_initialized = True
        self._K, self._V, self.n = keys, values, n
        rows = keys.shape[0] if rows is None else rows
        self._k, self._v = keys[:rows], values[:rows]
        self._views()

    def has_room(self, rows: int, width: int) -> bool:
        """Whether the buffers hold ``rows`` rows of ``width`` columns without growing."""
        return rows <= self._K.shape[0] and width <= self._K.shape[2]

    def append_rows(self, blocks: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> None:
        """Write ``blocks`` ((keys, values) [rows, heads, cols <= width, dim]) as the next rows, in
        the buffer's spare rows (:meth:`has_room` must hold), the cached columns becoming ``width``
        (columns past a row's own are zeroed: holes, masked, but finite)."""
        if width > self.n:
            for buf in (self._k, self._v):
                buf[:, :, self.n:width] = 0
        r = _write_rows((self._K, self._V), self._k.shape[0], blocks, width)
        self._k, self._v = self._K[:r], self._V[:r]
        self.n = max(self.n, width)
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, :self.n], self._v[:, :, :self.n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states``/``value_states`` [rows, heads, T, dim]; the cached columns
        ``start``.. [rows, heads, n + T - start, dim] are returned (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[2]
        if self.n + T > self._k.shape[2]:  # grow by an eighth, at least 64 columns (amortised O(T) per step,
            # little spare at 32k), or at once to the reserved columns (a chunked prefill copies no buffer)
            self.set(self.keys, self.values, room=T + max(64, self.n // 8, self.reserve - self.n - T),
                     row_room=self._K.shape[0] - self._k.shape[0])
        self._k[:, :, self.n:self.n + T] = key_states
        self._v[:, :, self.n:self.n + T] = value_states
        self.n += T
        self._views()
        return self._k[:, :, self.start:self.n], self._v[:, :, self.start:self.n]

    def move_rows(self, dst: torch.Tensor | None, src: torch.Tensor | None, rows: int, columns: int) -> None:
        """Copy rows ``src`` [K] over rows ``dst`` [K] (their first ``columns`` columns), then keep the
        first ``rows`` rows and ``columns`` columns: in the same buffer, unless that would leave
        half of its rows or more unused (then the kept ones are copied into a buffer of their own,
        so finished rows do not hold memory for long)."""
        if dst is not None:
            for buf in (self._k, self._v):
                buf[dst, :, :columns] = buf[src, :, :columns]
        self.n = min(self.n, columns)
        if 2 * rows <= self._k.shape[0]:  # (rows >= 1: BatchKV.keep_rows drops an emptied cache)
            self.set(self._k[:rows, :, :self.n], self._v[:rows, :, :self.n], room=64)
            return
        self._k, self._v = self._K[:rows], self._V[:rows]  # the freed rows stay, spare
        self._views()

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` columns (the buffer stays)."""
        self.n = min(self.n, n)
        self._views()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.is_initialized:
            self.truncate(self.n + tokens_to_remove)
        else:
            super().crop(tokens_to_remove)


def kv_shape(model) -> tuple[int, int, int]:
    """``model``'s layers, key/value heads and head dimension (what one token's keys take per layer)."""
    cfg = model.config.get_text_config(decoder=True)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return int(cfg.num_hidden_layers), heads, head_dim


def kv_bytes_per_token(model) -> int:
    """Bytes of KV cache one token takes in ``model``: keys and values of every layer, in its dtype."""
    layers, heads, head_dim = kv_shape(model)
    return 2 * layers * heads * head_dim * next(model.parameters()).element_size()


def new_cache(reserve: int = 0) -> Cache:
    """An empty cache whose layers are :class:`GrowingLayer`, created as the model first writes them
    (``reserve``: with room for that many columns at their first growth)."""
    return Cache(layer_class_to_replicate=functools.partial(GrowingLayer.reserving, reserve) if reserve
                 else GrowingLayer)


class BatchKV:
    """Rows of committed KV entries; ``lengths[b]`` columns of row b are valid."""

    def __init__(self, reserve: int = 0, max_rows: int = 0) -> None:
        """``max_rows``: the rows the cache will hold at most (a session's slots); buffers made by
        :meth:`add_rows` keep room for them, so rows admitted later are written in place."""
        self.hf = new_cache(reserve)
        self.lengths: list[int] = []
        self.max_rows = max_rows

    @classmethod
    def empty_row(cls, reserve: int = 0) -> "BatchKV":
        """A cache of one row with no columns yet (a prompt about to be prefilled; ``reserve``: its
        length, so a chunked prefill grows the buffers once)."""
        kv = cls(reserve)
        kv.lengths = [0]
        return kv

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        """Columns held (committed entries of the longest row, plus holes of the others)."""
        # not hf.get_seq_length(): it reads 0 for a layer with zero KV heads (a tensor-parallel rank
        # that holds no attention head, e.g. Gemma 3's single KV head under AutoTP)
        return next((layer.keys.shape[2] for layer in self._layers()), 0) if self.rows else 0

    def _layers(self):
        for layer in self.hf.layers:
            if type(layer) is not GrowingLayer:
                raise TypeError(f"unsupported cache layer {type(layer).__name__}; BatchKV needs GrowingLayer")
            # [rows, heads, cols, dim]
            if layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:
                yield layer

    def attend_from(self, starts: list[int] | None) -> None:
        """Layer i's attention reads its columns from ``starts[i]`` on in the next forward (the
        masks must match: :func:`~logitspec.worker.masks.pack` with ``trim``); None: every column."""
        for i, layer in enumerate(self.hf.layers):
            layer.start = starts[i] if starts is not None and i < len(starts) else 0

    def _device(self) -> torch.device:
        return next((layer.keys.device for layer in self._layers()), torch.device("cpu"))

    def commit(self, src_cols: list[list[int]]) -> None:
        """After a step appended ``T`` columns, keep for row b the columns ``src_cols[b]`` (ascending,
        absolute) right after its committed ones, and drop every other new column and hole past
        the longest row."""
        b_idx, src, dst = [], [], []
        for b, cols in enumerate(src_cols):
            start = self.lengths[b]
            for i, c in enumerate(cols):
                if c != start + i:
                    b_idx.append(b)
                    src.append(c)
                    dst.append(start + i)
            self.lengths[b] += len(cols)
        keep = max(self.lengths)
        if b_idx:
            bi, s, d = to_device(np.array([b_idx, src, dst], dtype=np.int64), self._device())  # [3, K]
        for layer in self._layers():
            if b_idx:
                for t in (layer.keys, layer.values):  # [rows, heads, columns, head_dim], views of the buffer
                    t[bi, :, d] = t[bi, :, s]
            layer.truncate(keep)

    def truncate(self, lengths: list[int]) -> None:
        """Row b keeps its first ``lengths[b]`` committed columns (at most its length): what was
        committed after them is dropped (a cost measurement rolling its cache back)."""
        if len(lengths) != self.rows or any(n > m for n, m in zip(lengths, self.lengths)):
            raise ValueError(f"cannot truncate rows of lengths {self.lengths} to {lengths}")
        self.lengths = list(lengths)
        keep = max(self.lengths, default=0)
        for layer in self._layers():
            layer.truncate(keep)

    def keep_rows(self, rows: list[int]) -> list[int]:
        """Release every row not in ``rows`` (finished sequences). Kept rows past the new row count
        move into the freed slots (one row's columns copied per freed slot; compacting the whole
        cache, as a finishing row used to, copied every row: 14 ms at 20 rows of 277 columns for
        Gemma 3 270M); once half the buffer's rows are free, the kept rows get a buffer of their own
        (:meth:`GrowingLayer.move_rows`). Returns the kept rows' old indices in their new order."""
        if rows == list(range(self.rows)):
            return list(rows)
        if not rows:
            self.lengths = []
            self.hf = new_cache()
            return []
        n = len(rows)
        order = list(range(n))  # new row -> old row
        for slot, src in zip(sorted(set(range(n)) - set(rows)), [r for r in rows if r >= n]):
            order[slot] = src
        moves = [(d, s) for d, s in enumerate(order) if d != s]
        self.lengths = [self.lengths[r] for r in order]
        keep = max(self.lengths)
        dst, src = (to_device(np.asarray(x, dtype=np.int64), self._device())
                    for x in zip(*moves)) if moves else (None, None)
        for layer in self._layers():
            layer.move_rows(dst, src, n, keep)
        return order

    def repeat_row(self, lengths: list[int]) -> None:
        """Turn this one-row cache into ``len(lengths)`` copies of its row, row b committing its
        first ``lengths[b]`` columns (the rest are holes); for cost measurements at batch."""
        assert self.rows == 1 and max(lengths) <= self.columns
        for layer in self._layers():
            layer.set(*(t.expand(len(lengths), *t.shape[1:]) for t in (layer.keys, layer.values)), room=64)
        self.lengths = list(lengths)

    def add_row(self, other: "BatchKV", copies: int = 1, take: bool = False) -> None:
        """Append ``copies`` copies of the single row of ``other`` (a prefilled sequence) as the last
        rows. ``other`` is copied, so it can be added again (several samples, a prefix cache),
        unless ``take``: then an empty cache adopts its buffers (``other`` must not be used after)."""
        assert other.rows == 1 and copies >= 1
        if take and self.rows == 0 and copies == 1:
            self.hf, self.lengths = other.hf, list(other.lengths)
            return
        self.add_rows([(other, 0, copies)])

    def add_rows(self, sources: list[tuple["BatchKV", int, int]]) -> None:
        """Append, in order, ``copies`` copies of row ``row`` of ``cache`` for each
        ``(cache, row, copies)`` in ``sources`` (the sources are copied, not changed): one new
        buffer per layer however many rows are added."""
        added = [n for src, r, copies in sources for n in [src.lengths[r]] * copies]
        if not any(src.columns for src, _, _ in sources):  # rows with no columns yet (nothing prefilled)
            if self.rows == 0:
                self.hf = new_cache()
            self.lengths += added
            return
        width = max([self.columns] + added)
        runs: list[tuple[BatchKV, list[int]]] = []  # consecutive sources from one cache: one gather
        for src, r, copies in sources:
            if not runs or runs[-1][0] is not src:
                runs.append((src, []))
            runs[-1][1].extend([r] * copies)
        src_layers = [(list(src._layers()), rows) for src, rows in runs]
        if len({len(x) for x, _ in src_layers}) != 1:
            raise ValueError("add_rows: every source row needs the same layers (none may be empty)")
        held = list(self._layers()) if self.rows else []  # this cache's layers, none while it is empty
        idx = [to_device(np.asarray(rows, dtype=np.int64), layers[0].keys.device)
               for layers, rows in src_layers]
        total = self.rows + len(added)
        spare = max(self.max_rows - total, 0)
        stacked = []  # the new buffers, while this cache is empty
        # in place when every layer's buffer has the rows and columns (a step's finished rows left
        # them): only the added rows are written, not the whole batch's cache again
        in_place = bool(held) and all(x.has_room(total, width) for x in held)
        for i in range(len(src_layers[0][0])):  # per layer: the added rows after the held ones
            new = [tuple(t.index_select(0, ix)[:, :, :width] for t in (layers[i].keys, layers[i].values))
                   for (layers, _), ix in zip(src_layers, idx)]
            if in_place:
                held[i].append_rows(new, width)
            elif held:  # one new buffer, the held rows then the added; this layer's old buffers go now
                held[i].adopt(*_stack_rows([(held[i].keys, held[i].values)] + new, width, row_room=spare),
                              width, rows=total)
            else:
                stacked.append(_stack_rows(new, width, row_room=spare))
        if not held:
            self.hf = _cache_holding(stacked, width, rows=total)
        self.lengths += added

    def split_row(self, lengths: list[int]) -> "BatchKV":
        """A new cache of ``len(lengths)`` rows from this one-row cache whose committed columns hold
        several sequences back to back: row b holds the b-th run of ``lengths[b]`` columns."""
        assert self.rows == 1 and sum(lengths) == self.lengths[0]
        width = max(lengths)
        offsets = np.cumsum([0] + list(lengths[:-1]))
        out = BatchKV()
        out.hf = _cache_holding([_stack_rows([(x.keys[:, :, o:o + n], x.values[:, :, o:o + n])
                                              for o, n in zip(offsets, lengths)], width)
                                 for x in self._layers()], width)
        out.lengths = list(lengths)
        return out

    def row_prefix(self, row: int, n: int) -> "BatchKV":
        """A compact one-row copy of the first ``n`` committed columns of ``row``."""
        assert 0 <= n <= self.lengths[row]
        out = BatchKV()
        out.hf = _cache_of([(x.keys[row:row + 1, :, :n], x.values[row:row + 1, :, :n])
                            for x in self._layers()], room=0)
        out.lengths = [n]
        return out

    @property
    def column_bytes(self) -> int:
        """Bytes of one column of one row (keys and values of every layer)."""
        return sum((x.keys.nbytes + x.values.nbytes) // max(1, x.keys.shape[0] * x.keys.shape[2])
                   for x in self._layers() if x.keys.shape[2])


def _cache_of(layers: list[tuple[torch.Tensor, torch.Tensor]], room: int = 64) -> Cache:
    """A cache whose layer i holds copies of ``layers[i]`` (keys, values) [rows, heads, cols, dim]."""
    n = layers[0][0].shape[2] if layers else 0
    return _cache_holding([_stack_rows([kv], n, room) for kv in layers], n)


def _cache_holding(buffers: list[tuple[torch.Tensor, torch.Tensor]], n: int,
                   rows: int | None = None) -> Cache:
    """A cache whose layer i adopts ``buffers[i]`` (keys, values) [row capacity, heads, capacity,
    dim], the first ``rows`` rows (default all) and ``n`` columns cached."""
    hf = new_cache()
    for k, v in buffers:
        layer = GrowingLayer()
        layer.lazy_initialization(k[:, :, :0], v[:, :, :0])
        layer.adopt(k, v, n, rows)
        hf.layers.append(layer)
    return hf


def _stack_rows(blocks: list[tuple[torch.Tensor, torch.Tensor]], width: int,
                room: int = 64, row_room: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """New key and value buffers [rows of all blocks + row_room, heads, width + room, dim] holding
    ``blocks`` ((keys, values) [rows, heads, cols <= width, dim]) one after another; a block's columns
    past its own up to ``width`` are zeroed (holes: masked, but they must be finite)."""
    ref = blocks[0][0]
    bufs = tuple(ref.new_empty(sum(k.shape[0] for k, _ in blocks) + row_room, ref.shape[1], width + room,
                               ref.shape[3]) for _ in range(2))
    _write_rows(bufs, 0, blocks, width)
    return bufs


def _write_rows(bufs: tuple[torch.Tensor, torch.Tensor], start: int,
                blocks: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> int:
    """Write ``blocks`` ((keys, values) [rows, heads, cols <= width, dim]) into the key and value
    buffers ``bufs`` from row ``start`` on, zeroing each block's columns past its own up to
    ``width``; returns the row after the last written."""
    r = start
    for block in blocks:
        n, cols = block[0].shape[0], block[0].shape[2]
        for buf, t in zip(bufs, block):
            buf[r:r + n, :, :cols] = t
            buf[r:r + n, :, cols:width] = 0
        r += n
    return r

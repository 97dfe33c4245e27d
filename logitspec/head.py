"""The target forward of one step: the decoder over all packed nodes, then logits only where needed.

On CPU the output projection (e.g. 262k x 640 for Gemma 3) is half of every step. Computing it as
``W @ h.T`` instead of ``F.linear(h, W)`` ran several times faster for a handful of rows on this
machine (docs/performance.md), and skipping padding nodes saves the rest. ``fast=False`` uses the
model's own forward (needed when the output layer is sharded, e.g. DeepSpeed AutoTP).
"""
from __future__ import annotations

import torch


class Head:
    def __init__(self, model, fast: bool = True):
        self.model = model
        emb = model.get_output_embeddings()
        cfg = model.config.get_text_config(decoder=True)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        usable = (emb is not None and getattr(emb, "bias", None) is None
                  and tuple(emb.weight.shape) == (cfg.vocab_size, cfg.hidden_size) and hasattr(model, "get_decoder"))
        self.fast = fast and usable
        if self.fast:
            self.decoder = model.get_decoder()
            self.weight = emb.weight  # [V, H]

    def __call__(self, ids, pos, mask, cache, select: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] (possibly a transposed view) of the flat node indices ``select`` [N] into the
        [B, T] batch; the cache gains all B x T new columns."""
        if self.fast:
            out = self.decoder(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True)
            h = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])[select]  # [N, H]
            logits = torch.mm(self.weight, h.T).T  # [N, V]
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return logits
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True)
        return out.logits.reshape(-1, out.logits.shape[-1])[select]

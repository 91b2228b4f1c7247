"""Any transformers causal LM behind the engine's model interface (the fallback path).

Slower than the lean Llama forward (transformers' own modules and a `DynamicCache`), but it
runs every architecture transformers knows. Rollback crops the cache to the slot's length.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class HFCache:
    """One sequence's `DynamicCache` with the `lengths`/`max_len` the decode loop moves."""

    def __init__(self, config, max_len: int):
        self.cache = DynamicCache(config=config)
        self.lengths = [0]
        self.max_len = max_len


class HFCausalModel:
    def __init__(self, hf_model):
        self.hf_model = hf_model
        self.config = hf_model.config
        self.max_positions = getattr(hf_model.config, "max_position_embeddings", 4096)
        self.vocab_size = hf_model.config.vocab_size

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> HFCache:
        if batch != 1:
            raise ValueError("the transformers fallback path decodes one sequence at a time")
        return HFCache(self.config, max_len or self.max_positions)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: HFCache, slots: list[int] | None = None) -> torch.Tensor:
        kept = cache.lengths[0]
        stale = cache.cache.get_seq_length() - kept
        if stale > 0:
            cache.cache.crop(-stale)  # drop rejected draft positions (transformers 5: a negative count)
        out = self.hf_model.base_model(input_ids=tokens, past_key_values=cache.cache, use_cache=True)
        cache.lengths[0] = kept + tokens.shape[1]
        return out.last_hidden_state

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf_model.get_output_embeddings()(hidden).float()

"""EAGLE-style drafting: a small head over the target's own hidden states.

The generator hands the drafter the target's final hidden states of every token it fed and
kept (`observe`). Before proposing, the head catches up on the positions it has not seen: row t
reads (f_t, x_{t+1}); the last such row is at the position of the token before the emitted but
not yet fed one, and its output is the head's guess of that token's feature, whose LM-head
argmax (over the draft vocabulary) is the first draft. Further drafts feed the guessed feature
and the drafted token back in. Head cache entries of drafts are overwritten later (a row
attends only up to its own position), so rolling back costs nothing.

Greedy requests draft the argmax (one-hot q, like n-gram). Sampled requests draw from the
head's processed distribution over the draft vocabulary and report it as q, so rejection
sampling stays exact.
"""

from __future__ import annotations

import torch

from openalice_runner.engine.drafters.base import Drafter, Proposal
from openalice_runner.engine.sampling import processed_probs
from openalice_runner.engine.types import SamplingParams


class EagleDrafter(Drafter):
    name = "eagle"
    wants_hidden = True

    def __init__(self, runtime, max_len: int, vocab_size: int | None = None):
        """`runtime`: an `EagleRuntime` (or anything with its `new_cache`, `step`, `logits`, `vocab`)."""
        self.runtime = runtime
        self.feature_layers = tuple(getattr(getattr(runtime, "cfg", None), "taps", ()))
        self.vocab_size = vocab_size
        self.cache = runtime.new_cache(max_len)
        self.max_len = self.cache[0].shape[2]
        self.feats: torch.Tensor | None = None  # (capacity, H) target features, row = position
        self.n_feats = 0
        self.seen = 0  # positions whose true rows are in the head's cache

    def start(self, prompt: list[int]) -> None:
        self.n_feats = 0
        self.seen = 0

    def observe(self, hidden: torch.Tensor) -> None:
        rows = hidden.shape[0]
        need = self.n_feats + rows
        if self.feats is None or self.feats.shape[0] < need:
            grown = torch.empty(max(need, 2 * (0 if self.feats is None else self.feats.shape[0]), 256),
                                hidden.shape[-1])
            if self.feats is not None and self.n_feats:
                grown[: self.n_feats] = self.feats[: self.n_feats]
            self.feats = grown
        self.feats[self.n_feats : need] = hidden.float()
        self.n_feats = need

    def propose(self, history: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        last = len(history) - 2  # position of the last fed token; history[-1] is not fed yet
        if last < 0 or self.n_feats != last + 1:
            return Proposal([])  # features out of step (e.g. observe not wired): draft nothing
        gamma = min(gamma, self.max_len - 1 - last)
        if gamma <= 0:
            return Proposal([])
        rt = self.runtime
        start = min(self.seen, last)
        positions = list(range(start, last + 1))
        out = rt.step(self.cache, self.feats[start : last + 1], history[start + 1 : last + 2], positions)
        self.seen = last + 1
        feat = out[-1:]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        pos = last + 1
        for i in range(gamma):
            sub = rt.logits(feat)[0]
            if sampling.greedy:
                token = int(rt.vocab[int(sub.argmax())])
            else:
                full = torch.full((self.vocab_size or int(rt.vocab.max()) + 1,), float("-inf"))
                full[rt.vocab] = sub
                probs = processed_probs(full, sampling)
                token = int(torch.multinomial(probs, 1, generator=generator).item())
                rows.append(probs)
            tokens.append(token)
            if i + 1 < gamma:
                feat = rt.step(self.cache, feat, [token], [pos])
                pos += 1
        return Proposal(tokens, torch.stack(rows) if rows else None)

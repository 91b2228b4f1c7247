"""Training an EAGLE head by self-distillation, within a wall-clock budget.

Each step takes a window of a distilled sequence (target features f_t and tokens) that holds
its whole reply after as much of the prompt as fits, runs the head unrolled for `unroll` draft
steps (step s > 1 reads step s-1's predicted feature, as the drafter does) and minimises, per
step, the cross-entropy between the head's draft-vocabulary distribution and the target's
(soft targets from the true next feature), plus a small smooth-L1 term on the predicted
feature (an EAGLE-3 head, whose hidden state is its own, has the cross-entropy alone, as
SpecForge trains it). The learning rate warms up and then decays linearly with the time left, so a run of
any length ends annealed. Held-out acceptance is the share of reply positions (where the head
drafts) at which its first draft equals the target's greedy token, and `tokens/pass` estimates
the mean tokens per target pass of a chain of `EVAL_DRAFTS` drafts (or `unroll`, if more) on
held-out text: the same figure whatever the head was trained with.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openalice_runner.engine.eagle.eagle3 import Eagle3Config, Eagle3Head
from openalice_runner.engine.eagle.head import EagleHead, HeadConfig
from openalice_runner.training.data import Sample

EVAL_DRAFTS = 3  # chain length of the held-out tokens/pass estimate


@dataclass
class TrainSettings:
    seconds: float = 600.0  # wall-clock budget of the training loop
    unroll: int = 3  # draft steps trained per position
    window: int = 512  # tokens per sequence window
    # windows are accumulated up to this many tokens per optimizer step. Small steps learn more per
    # CPU second: on the same cached samples and held-out set, 256 tokens (about one reply) took
    # 898 steps in 300 s to acc@1 0.674, 512 took 567 steps to 0.665, 1024 took 247 in 240 s to 0.608
    tokens_per_step: int = 256
    lr: float = 1e-3
    warmup_steps: int = 20
    feature_weight: float = 0.2
    prompt_weight: float = 1.0  # loss weight of prompt rows (the head only drafts replies, but 0 or 0.2 trained worse)
    eval_every_s: float = 60.0
    # the steps' matmuls in bf16 (torch autocast; weights, optimizer state and evaluation stay
    # fp32): 430 against 721 ms a step on Zen 4 (AVX512-BF16), the same losses over 30 steps
    bf16: bool = False
    seed: int = 0
    max_steps: int | None = None


def draft_vocabulary(samples: list[Sample], size: int, always: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The `size` most frequent tokens of the samples (replies weigh double), plus `always`."""
    counts: Counter = Counter()
    for s in samples:
        counts.update(s.tokens.tolist())
        counts.update(s.tokens[s.prompt_len :].tolist())
    vocab = [t for t in always]
    for t, _ in counts.most_common():
        if len(vocab) >= size:
            break
        if t not in always:
            vocab.append(int(t))
    return vocab


class Trainer:
    def __init__(self, model, head: EagleHead | Eagle3Head, settings: TrainSettings):
        self.model = model
        self.head = head
        self.s = settings
        vocab = torch.tensor(head.cfg.draft_vocab)
        self.vocab = vocab
        self.lm_sub = model.lm_head.weight.detach()[vocab].float()  # (N, H) frozen
        self.embed = model.embed
        self.opt = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.95))
        # an EAGLE-3 head (eagle3.py) reads its taps alone, predicts tokens through its own LM head
        # and has no feature target; the `eagle` head predicts f_{t+1}, read by the target's LM head
        self.predicts_features = getattr(head, "predicts_features", True)
        self.rng = random.Random(settings.seed)
        self.step = 0

    def _window(self, s: Sample, window: int, start: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(features, next-token embeddings, start, first reply row) of a window of `s`. By
        default the window ends at the sequence's end, so it holds the whole reply (replies are
        shorter than a window) after as much of the prompt as fits; a longer reply gets a
        random window inside it."""
        length = s.feats.shape[0]
        if start is None:
            start = max(0, length - window)
            reply = s.prompt_len - 1  # the first row the head drafts from
            if length - reply > window:  # keep a quarter of the window for context
                start = self.rng.randint(min(start, max(0, reply - window // 4)), start)
        end = min(length, start + window)
        feats = s.feats[start:end].float()
        nxt = self.embed[s.tokens[start + 1 : end + 1]].float()
        return feats, nxt, start, max(0, s.prompt_len - 1 - start)

    def head_inputs(self, feats: torch.Tensor) -> torch.Tensor:
        """A window's stored feature rows -> what the head's unrolled forward reads."""
        return self.head.training_rows(feats) if hasattr(self.head, "training_rows") else feats

    def draft_logits(self, pred: torch.Tensor) -> torch.Tensor:
        """The head's outputs -> logits over the draft vocabulary."""
        return pred @ self.lm_sub.t() if self.predicts_features else self.head.logits(pred)

    def row_weights(self, length: int, first_reply: int) -> torch.Tensor:
        """Loss weight of rows 0..length-2: 1 where the head drafts (the row before the reply's
        first token onwards), `prompt_weight` inside the prompt."""
        w = torch.ones(max(0, length - 1))
        w[: min(first_reply, w.shape[0])] = self.s.prompt_weight
        return w

    def losses(self, feats: torch.Tensor, nxt: torch.Tensor, start: int, first_reply: int = 0) -> tuple[torch.Tensor, float]:
        """The window's loss (weighted mean over rows, summed over unrolled steps) and its
        weight (rows that count)."""
        outs = self.head.forward_unrolled(self.head_inputs(feats), nxt, self.s.unroll, start)
        length = feats.shape[0]
        weights = self.row_weights(length, first_reply)
        final = feats[:, -self.head.cfg.hidden :]  # f_t; taps (if any) come before it
        with torch.no_grad():
            target_logp = torch.log_softmax(final[1:] @ self.lm_sub.t(), dim=-1)  # rows t+1 = 1..L-1
            target_p = target_logp.exp()
        total = feats.new_zeros(())
        for s, pred in enumerate(outs, start=1):
            lo = s - 1
            w = weights[lo:]
            if lo >= length - 1 or float(w.sum()) <= 0:
                break
            p = pred[lo : length - 1]
            logq = torch.log_softmax(self.draft_logits(p), dim=-1)
            per_row = -(target_p[lo:] * logq).sum(-1)
            if self.predicts_features:
                reg = F.smooth_l1_loss(p, final[lo + 1 :], reduction="none").mean(-1)
                per_row = per_row + self.s.feature_weight * reg
            total = total + (0.8 ** (s - 1)) * (w * per_row).sum() / w.sum()
        return total, float(weights.sum())

    def _precision(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.s.bf16 else contextlib.nullcontext()

    def lr_at(self, frac_time: float) -> float:
        warm = min(1.0, (self.step + 1) / self.s.warmup_steps)
        return self.s.lr * warm * max(0.05, 1.0 - frac_time)

    def train_step(self, samples: list[Sample], frac_time: float) -> float:
        self.head.train()
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(frac_time)
        self.opt.zero_grad(set_to_none=True)
        tokens = 0
        loss_sum = 0.0
        while tokens < self.s.tokens_per_step:
            sample = self.rng.choice(samples)
            window = self._window(sample, self.s.window)
            if window[0].shape[0] < 2:
                continue
            # entered per window: autocast caches its bf16 copies of the weights until it exits
            with self._precision():
                loss, weight = self.losses(*window)
            if weight <= 0:
                continue
            share = weight / self.s.tokens_per_step
            (loss * share).backward()
            loss_sum += float(loss.detach()) * share
            tokens += weight
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        return loss_sum * self.s.tokens_per_step / tokens

    @torch.no_grad()
    def evaluate(self, heldout: list[Sample], truth: list[torch.Tensor]) -> dict:
        """acc@1 (first draft = target's greedy token) and the estimated tokens per target pass."""
        self.head.eval()
        hits = total = 0
        chain_sum = chains = 0
        for s, top1 in zip(heldout, truth, strict=True):
            feats, nxt, start, first = self._window(s, 1024, start=max(0, s.feats.shape[0] - 1024))
            outs = self.head.forward_unrolled(self.head_inputs(feats), nxt, max(self.s.unroll, EVAL_DRAFTS), start)
            length = feats.shape[0]
            want = top1[start + 1 : start + length]  # target's greedy token after f_{t+1}, rows t = 0..L-2
            correct = []
            for pred in outs:
                ids = self.vocab[self.draft_logits(pred[: length - 1]).argmax(-1)]
                correct.append(ids == want)
            # rows where the head drafts: the reply (a prompt's rows are the user's text, not the model's)
            hits += int(correct[0][first:].sum())
            total += max(0, length - 1 - first)
            # a chain started at row u drafts rows u, u+1, ... with steps 1, 2, ...
            for u in range(first, length - 1):
                n = 0
                while n < len(correct) and u + n < length - 1 and bool(correct[n][u + n]):
                    n += 1
                chain_sum += n
                chains += 1
        return {"acc1": hits / max(1, total), "tokens_per_pass": 1.0 + chain_sum / max(1, chains)}


def target_top1(model, samples: list[Sample]) -> list[torch.Tensor]:
    """The target's greedy token after each feature, over the full vocabulary (held-out truth)."""
    out = []
    hidden = model.cfg.hidden
    with torch.inference_mode():
        for s in samples:
            rows = []
            for i in range(0, s.feats.shape[0], 256):
                rows.append(model.logits(s.feats[i : i + 256, -hidden:].float()).argmax(-1))
            out.append(torch.cat(rows))
    return out


def new_head(cfg: HeadConfig | Eagle3Config) -> EagleHead | Eagle3Head:
    """An untrained head of the config's layout."""
    return Eagle3Head(cfg) if isinstance(cfg, Eagle3Config) else EagleHead(cfg)


def train_head(model, cfg: HeadConfig | Eagle3Config, train: list[Sample], heldout: list[Sample],
               settings: TrainSettings, progress: Callable[[dict], None] | None = None,
               head: EagleHead | Eagle3Head | None = None) -> tuple[EagleHead | Eagle3Head, dict]:
    """Train within `settings.seconds`; returns the head and its final figures."""
    torch.manual_seed(settings.seed)
    if head is None:
        head = new_head(cfg)
        head.init_from_target(model)
    start = time.monotonic()  # the budget covers the held-out evaluations too
    trainer = Trainer(model, head, settings)
    truth = target_top1(model, heldout) if heldout else []
    last_eval = start
    figures: dict = {"steps": 0, "loss": math.nan, "first_loss": math.nan}
    if heldout:
        figures.update({f"initial_{k}": v for k, v in trainer.evaluate(heldout, truth).items()})
    ema = None
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= settings.seconds or (settings.max_steps is not None and trainer.step >= settings.max_steps):
            break
        loss = trainer.train_step(train, elapsed / settings.seconds)
        ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        if trainer.step == 1:
            figures["first_loss"] = loss
        figures.update(steps=trainer.step, loss=ema)
        now = time.monotonic()
        if heldout and now - last_eval >= settings.eval_every_s and now - start < 0.9 * settings.seconds:
            figures.update(trainer.evaluate(heldout, truth))
            last_eval = now
        if progress:
            progress(dict(figures, elapsed=now - start))
    if heldout:
        figures.update(trainer.evaluate(heldout, truth))
    figures["train_seconds"] = round(time.monotonic() - start, 1)
    head.eval()
    return head, figures

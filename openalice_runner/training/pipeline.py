"""Prompts -> self-distilled samples (cached) -> a trained head saved to a folder, in a time budget."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from openalice_runner.engine.eagle.eagle3 import Eagle3Config, default_taps
from openalice_runner.engine.eagle.head import (
    HeadConfig,
    check_feature_layers,
    default_feature_layers,
    target_fingerprint,
)
from openalice_runner.engine.model_loading import cache_root
from openalice_runner.engine.prefill_choice import cpu_bf16_flags
from openalice_runner.providers.embedded import tool_format
from openalice_runner.training.data import (
    Sample,
    SampleCache,
    distill,
    exclude_prompts,
    prompt_key,
    read_chats,
    read_prompts,
)
from openalice_runner.training.train import TrainSettings, draft_vocabulary, train_head


@dataclass
class BuildSettings:
    minutes: float = 30.0  # bounds the whole build: distillation + training + saving
    gen_minutes: float | None = None  # distillation share of the budget (default 40%)
    max_new_tokens: int = 192
    batch: int = 24  # 24 at a time: 275 reply tok/s here against 203 for 8
    draft_vocab: int = 4096
    # draft steps trained per position. 1 on a CPU budget: three times the optimizer steps of
    # unroll 3 in the same minutes (1,247 against 473 in 20 minutes), held-out acc@1 0.67 against
    # 0.56, and more tokens per pass in `bench` even on chained drafts (README, EAGLE draft head).
    # None: that 1 for `eagle`, EAGLE3_UNROLL for `eagle3`
    unroll: int | None = None
    tokens_per_step: int = TrainSettings.tokens_per_step  # per optimizer step (that field says why)
    lr: float = TrainSettings.lr
    # "auto": the training steps' matmuls in bf16 where the CPU has AVX512-BF16 or AMX (Zen 4: 1.7x the
    # steps in the same minutes), fp32 elsewhere (bf16 is emulated and slower there); "bf16", "fp32"
    train_dtype: str = "auto"
    # target layers fused with f_t: None (f_t alone), "eagle3" (low, middle, high) or indices
    feature_layers: list[int] | str | None = "eagle3"
    # "eagle": the runner's own layout (head.py); "eagle3": SpecForge's folder, which vLLM and SGLang
    # load (eagle3.py), at SpecForge's default layers, the only ones both engines read alike
    layout: str = "eagle"
    heldout_every: int = 20  # one prompt in this many (by hash) is held out
    max_heldout: int = 24
    max_prompts: int | None = None
    max_steps: int | None = None
    seed: int = 0
    progress: bool = True
    data_dir: Path | None = None  # distilled-sample cache (default: the runner cache's eagle-data/)


# An eagle3 head has no feature loss: the hidden state it feeds back is trained by the unrolled
# steps alone (SpecForge unrolls 7). A head trained with --unroll 2 accepted next to nothing at
# draft position 3 (0.000 in vLLM, 0.003 embedded, against 0.078 at position 2; docs/benchmarks/2026-11-30-eagle-head.md), so
# an eagle3 head unrolls as many steps as the 3 speculative tokens the docs serve it with.
EAGLE3_UNROLL = 3


TRAIN_DTYPES = ("auto", "bf16", "fp32")


def train_bf16(train_dtype: str) -> bool:
    """Whether the training steps run their matmuls in bf16 (`BuildSettings.train_dtype`)."""
    if train_dtype not in TRAIN_DTYPES:
        raise ValueError(f"train_dtype: {train_dtype!r} is not one of {', '.join(TRAIN_DTYPES)}")
    return train_dtype == "bf16" or (train_dtype == "auto" and bool(cpu_bf16_flags()))


def default_out(model_name: str, layout: str = "eagle") -> Path:
    return cache_root() / "eagle-heads" / (model_name if layout == "eagle" else f"{model_name}-{layout}")


def data_folder(fingerprint: dict) -> Path:
    return cache_root() / "eagle-data" / f"{fingerprint['name']}-{fingerprint['lm_head_sha256']}"


def _bar(total: float, desc: str, unit: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _head_layers(s: BuildSettings, n_layers: int) -> list[int]:
    """The target layers the head reads, in its order (none: f_t alone)."""
    layers = s.feature_layers
    if s.layout not in ("eagle", "eagle3"):
        raise ValueError(f"layout: {s.layout!r} is not 'eagle' or 'eagle3'")
    if s.layout == "eagle3":
        if layers != "eagle3":
            raise ValueError(f"feature_layers: {layers!r} with layout 'eagle3', whose layers are SpecForge's "
                             "default (vLLM and SGLang read an explicit list one layer apart)")
        layers = default_taps(n_layers)
    elif layers == "eagle3":
        layers = default_feature_layers(n_layers)
    elif isinstance(layers, str):
        raise ValueError(f"feature_layers: {layers!r} is not None, 'eagle3' or a list of layer indices")
    check_feature_layers(layers, n_layers)
    return list(layers or ())


def _training_prompts(
    data: list[str | Path], exclude: list[str | Path] | None, max_prompts: int | None
) -> tuple[list, int]:
    """The chats of `data` less those whose prompts `exclude` holds, at most `max_prompts`; and how
    many were read."""
    chats = read_chats(data)
    n_read = len(chats)
    if exclude:
        kept = {id(m) for m in exclude_prompts([c.messages for c in chats], read_prompts(exclude))}
        chats = [c for c in chats if id(c.messages) in kept]
    if max_prompts:
        chats = chats[:max_prompts]
    if not chats:
        raise ValueError("no training prompts left (after excluding the benchmark prompts)")
    return chats, n_read


def build_head(engine, data: list[str | Path], out: str | Path | None = None,
               exclude: list[str | Path] | None = None, settings: BuildSettings | None = None) -> tuple[Path, dict]:
    """Train a head for `engine`'s model on prompts from `data` (JSON lines), excluding the
    prompts of `exclude`; returns the folder it was saved to and its figures."""
    s = settings or BuildSettings()
    t0 = time.monotonic()
    deadline = t0 + s.minutes * 60.0
    model = engine.model
    head_layers = _head_layers(s, model.cfg.n_layers)
    bf16 = train_bf16(s.train_dtype)  # checked before the minutes of distillation
    taps = tuple(sorted(set(head_layers)))  # as a pass taps them: distinct, ascending
    fingerprint = target_fingerprint(engine.model_name, model)
    chats, n_read = _training_prompts(data, exclude, s.max_prompts)
    # rendered as the embedded provider renders the request (tools, tool calls and results included)
    ids = [tool_format.render_ids(engine, c.messages, c.tools) for c in chats]
    keys = [prompt_key(fingerprint, p, s.max_new_tokens, taps) for p in ids]
    unique = dict(zip(keys, ids, strict=True))
    heldout_keys = [k for k in unique if int(k, 16) % s.heldout_every == 0][: s.max_heldout]

    cache = SampleCache(s.data_dir or data_folder(fingerprint))
    samples: dict[str, Sample] = {}
    todo = []
    for k, p in unique.items():
        got = cache.get(k)
        if got is not None:
            samples[k] = got
        else:
            todo.append((k, p))
    held = set(heldout_keys)
    gen_minutes = s.gen_minutes if s.gen_minutes is not None else 0.4 * s.minutes
    gen_deadline = min(deadline, t0 + gen_minutes * 60.0)
    if todo and time.monotonic() < gen_deadline:
        bar = _bar(len(todo), "distilling", "prompt", s.progress)

        def keep(sample: Sample) -> None:
            if sample.complete:
                cache.put(sample)
            samples[sample.key] = sample
            bar.update(1)
            bar.set_postfix(tokens=sum(x.feats.shape[0] for x in samples.values()))

        distill(engine, [p for _, p in todo], [k for k, _ in todo], s.max_new_tokens, batch=s.batch,
                deadline=gen_deadline, on_sample=keep, taps=taps)
        bar.close()
    heldout = [samples[k] for k in heldout_keys if k in samples]
    train = [v for k, v in samples.items() if k not in held]
    if not train:
        raise ValueError("no training samples: raise --minutes or --gen-minutes")
    n_tokens = sum(x.feats.shape[0] for x in train)
    reply_tokens = sum(x.feats.shape[0] - x.prompt_len for x in train)

    vocab = draft_vocabulary(train, min(s.draft_vocab, model.cfg.vocab_size), always=set(engine.eos_token_ids))
    if s.layout == "eagle3":
        cfg = Eagle3Config.for_target(engine.model_name, model, vocab, feature_layers=head_layers)
    else:
        cfg = HeadConfig.for_target(engine.model_name, model, vocab, feature_layers=list(taps) or None)
    seconds = max(1.0, deadline - time.monotonic() - 5.0)  # leave time to save
    unroll = s.unroll or (EAGLE3_UNROLL if s.layout == "eagle3" else 1)
    tset = TrainSettings(seconds=seconds, unroll=unroll, tokens_per_step=s.tokens_per_step, lr=s.lr,
                         bf16=bf16, seed=s.seed, max_steps=s.max_steps,
                         eval_every_s=max(10.0, seconds / 10))
    bar = _bar(round(seconds), "training", "s", s.progress)

    def progress(f: dict) -> None:
        bar.n = min(round(f["elapsed"]), bar.total)
        post = {"step": f["steps"], "loss": f"{f['loss']:.3f}"}
        if "acc1" in f:
            post.update(acc1=f"{f['acc1']:.3f}", tok_per_pass=f"{f['tokens_per_pass']:.2f}")
        bar.set_postfix(post)

    torch.manual_seed(s.seed)
    # an engine on its kernels leaves torch one thread; training is torch's work alone (on two AVX2
    # cores a step takes 0.53 s on two threads, 0.88 on one)
    with engine.torch_work():
        threads = torch.get_num_threads()
        head, figures = train_head(model, cfg, train, heldout, tset, progress=progress)
    bar.close()
    figures.update(
        minutes_total=round((time.monotonic() - t0) / 60.0, 2),
        prompts_read=n_read, prompts_used=len(unique), train_samples=len(train), heldout_samples=len(heldout),
        train_tokens=n_tokens, reply_tokens=reply_tokens, draft_vocab=len(vocab), unroll=unroll,
        tokens_per_step=s.tokens_per_step, lr=s.lr, train_dtype="bf16" if bf16 else "fp32",
        max_new_tokens=s.max_new_tokens, dtype=engine.dtype, feature_layers=head_layers or None, layout=s.layout,
        train_threads=threads,
    )
    head.cfg.trained = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()}
    folder = head.save(out or default_out(engine.model_name, s.layout))
    return folder, head.cfg.trained

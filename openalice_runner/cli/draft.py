"""`openalice-runner draft`: train an EAGLE-style draft head on the target's own outputs.

    draft prompts --out FILE [--n N]            write a built-in prompt set (JSON lines)
    draft train --data FILE... [--out DIR] [--minutes N] [--exclude FILE...] [--layout eagle|eagle3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from openalice_runner.cli.common import add_engine_args, positive_float, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("draft", help="train EAGLE-style draft heads for the embedded engine")
    dsub = p.add_subparsers(dest="draft_command", required=True, metavar="SUBCOMMAND")

    t = dsub.add_parser("train", help="self-distil a draft head from prompts (JSON lines)")
    t.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="JSON-lines prompt files: `messages` (workload / saved traffic) or `prompt` per line")
    t.add_argument("--out", default=None,
                   help="folder for the head (default: the runner cache's eagle-heads/MODEL, MODEL-eagle3 for eagle3)")
    t.add_argument("--layout", choices=("eagle", "eagle3"), default="eagle",
                   help="eagle: the runner's own head (the default); eagle3: SpecForge's LlamaForCausalLMEagle3 "
                        "folder (config.json + model.safetensors) that vLLM and SGLang load as it is, "
                        "at SpecForge's default layers")
    t.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget of the whole run (default 30)")
    t.add_argument("--gen-minutes", type=float, default=None,
                   help="part of the budget for generating new target replies (default 40%%; cached ones are free)")
    t.add_argument("--exclude", action="append", default=[], metavar="FILE",
                   help="JSON-lines files whose prompts must not be trained on (e.g. the benchmark workload)")
    t.add_argument("--max-new-tokens", type=positive_int, default=192, help="reply length distilled per prompt")
    t.add_argument("--batch", type=positive_int, default=24, help="prompts decoded together while distilling")
    t.add_argument("--draft-vocab", type=positive_int, default=4096, help="draft vocabulary size (top-N tokens)")
    t.add_argument("--unroll", type=positive_int, default=None,
                   help="draft steps trained per position (default 1: more steps in a CPU budget; "
                        "more than 1 trains later chain steps on the head's own features, as EAGLE-3; "
                        "default 3 for --layout eagle3, whose fed-back state is trained by unrolling alone)")
    t.add_argument("--tokens-per-step", type=positive_int, default=256,
                   help="training tokens per optimizer step (default 256, about one reply: more steps per CPU second)")
    t.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (default 0.001)")
    t.add_argument("--train-dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the training steps' matmuls: bf16 (autocast; weights and optimizer stay fp32), fp32, or "
                        "auto: bf16 where the CPU has AVX512-BF16 or AMX, fp32 elsewhere (default)")
    t.add_argument("--feature-layers", type=feature_layers, default=argparse.SUPPRESS, metavar="eagle3|none|I,J,K",
                   help="target layers whose residual stream the head fuses with the final hidden state: "
                        "eagle3 (low, middle and high layers; the default), none (final state alone) or indices; "
                        "not with --layout eagle3, whose layers are fixed")
    t.add_argument("--max-prompts", type=positive_int, default=None)
    t.add_argument("--max-steps", type=positive_int, default=None, help="stop after this many optimizer steps")
    t.add_argument("--seed", type=int, default=0)
    add_engine_args(t)
    t.set_defaults(func=run_train)

    pr = dsub.add_parser("prompts", help="write the built-in training prompt set (JSON lines)")
    pr.add_argument("--out", required=True)
    pr.add_argument("--n", type=positive_int, default=1500)
    pr.add_argument("--seed", type=int, default=0)
    pr.set_defaults(func=run_prompts)


def feature_layers(text: str) -> str | list[int] | None:
    text = text.strip().lower()
    if text in ("none", "eagle3"):
        return None if text == "none" else text
    try:
        layers = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not none, eagle3 or comma-separated layer indices") from None
    if not layers or layers[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r} needs layer indices >= 0")
    return layers


def run_prompts(args: argparse.Namespace) -> int:
    from openalice_runner.training.data import builtin_prompts

    rows = builtin_prompts(args.n, seed=args.seed)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {args.out}", file=sys.stderr)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from openalice_runner.cli.common import load_engine
    from openalice_runner.training.pipeline import BuildSettings, build_head

    layers = getattr(args, "feature_layers", "eagle3")
    if args.layout == "eagle3" and hasattr(args, "feature_layers"):
        print("error: --feature-layers: not with --layout eagle3, whose layers are SpecForge's default "
              "(vLLM and SGLang read an explicit list one layer apart)", file=sys.stderr)
        return 2
    settings = BuildSettings(
        minutes=args.minutes, gen_minutes=args.gen_minutes, max_new_tokens=args.max_new_tokens, batch=args.batch,
        draft_vocab=args.draft_vocab, unroll=args.unroll, tokens_per_step=args.tokens_per_step, lr=args.lr,
        train_dtype=args.train_dtype,
        max_prompts=args.max_prompts, max_steps=args.max_steps,
        seed=args.seed, feature_layers=layers, layout=args.layout,
    )
    engine = load_engine(args)
    try:
        folder, figures = build_head(engine, args.data, args.out, args.exclude, settings)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"head": str(folder), **figures}, indent=1))
    print(f"use it with: --spec eagle --eagle-head {folder}  (policy: options: {{eagle_head: {folder}}})",
          file=sys.stderr)
    if args.layout == "eagle3":
        print(f"vLLM: --speculative-config '{{\"method\":\"eagle3\",\"model\":\"{folder}\","
              f"\"num_speculative_tokens\":3}}'; SGLang: --speculative-algorithm EAGLE3 "
              f"--speculative-draft-model-path {folder}", file=sys.stderr)
    return 0

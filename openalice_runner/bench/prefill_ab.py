"""Prefill A/B in one process: fp32 prefill with prompt rows' attention on the decode kernel or on
the fp32 prompt tiles; where the CPU has bf16 dot products, bf16 linears only, bf16 linears and attention.

Round-robin over them, medians of odd repeats, on one random prompt of --tokens tokens fed in
the serial loop's 512-token chunks (no tokenising, no reply). --cpu-time with --threads 1 times
process CPU seconds instead of wall seconds: on a machine shared with other work that figure does
not move with their load. Also prints the first-token logits' largest difference from the first
mode's (fp32 prefill whose prompt rows get a decode row's bits).

    HF_HUB_OFFLINE=1 .venv/bin/python -m openalice_runner.bench.prefill_ab --tokens 1000 --repeats 5 [--threads 1 --cpu-time]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from openalice_runner.engine import Engine
from openalice_runner.engine.generator import PREFILL_CHUNK


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpu-time", action="store_true")
    args = p.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    engine = Engine.load(max_batch=1, threads=args.threads, prefill="bf16")
    print(engine.prefill.reason, "| torch", torch.__version__, torch.backends.cpu.get_cpu_capability())
    model = engine.model
    torch.manual_seed(0)
    tokens = torch.randint(100, 40000, (1, args.tokens))
    cache = model.new_cache(1, args.tokens + 8)
    # (bf16 linears, bf16 attention, fp32 prompt tiles' attention) for prompt rows
    modes = {"fp32, decode kernel's attention": (False, False, False), "fp32, prompt tiles' attention": (False, False, True)}
    if model.attention_bf16:  # without bf16 dot products the bf16 modes are an emulation: no figure
        modes |= {"bf16 linears": (True, False, False), "bf16 linears + attention": (True, True, False)}
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    logits: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for name, (linears, attention, tiles) in modes.items():
            model.prefill_bf16, model.attention_bf16, model.prompt_attention_fp32 = linears, attention, tiles
            cache.lengths[0] = 0
            t0 = clock()
            for i in range(0, args.tokens, PREFILL_CHUNK):
                hidden = model.forward(tokens[:, i : i + PREFILL_CHUNK], cache, [0], prompt=True)
            logits[name] = model.logits(hidden[0, -1])
            seconds[name].append(clock() - t0)
    unit = "tokens per CPU second" if args.cpu_time else "tokens/s"
    first = next(iter(modes))
    base = statistics.median(seconds[first])
    for name, runs in seconds.items():
        med = statistics.median(runs)
        diff = (logits[name] - logits[first]).abs().max().item()
        print(f"{name}: {args.tokens / med:.0f} {unit} (x{base / med:.2f}; runs {[round(args.tokens / s) for s in runs]}); "
              f"first-token logits max diff {diff:.4f} of {logits[first].abs().max().item():.1f}")


if __name__ == "__main__":
    main()

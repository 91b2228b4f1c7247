"""`openalice-runner generate`: one completion on the embedded engine, with its figures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from openalice_runner.cli.common import add_engine_args, load_engine, load_policy, positive_int
from openalice_runner.speculation import SPEC_METHODS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate one completion on the embedded engine")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message text")
    src.add_argument("--messages-file", help="JSON file with a list of OpenAI-style messages")
    p.add_argument("--spec", choices=SPEC_METHODS, default="off",
                   help="speculation method")
    p.add_argument("--gamma", type=positive_int, default=5, help="draft tokens per round")
    p.add_argument("--draft-layers", type=positive_int, default=None, help="self-draft from the first N layers")
    p.add_argument("--eagle-head", default=None, help="folder of a trained EAGLE head (`draft train`)")
    p.add_argument("--eagle-lookup", action="store_true",
                   help="with --spec eagle: draft by prompt lookup where the context has a match worth it")
    p.add_argument("--eagle-tree", type=int, default=0, metavar="N",
                   help="with --spec eagle: draft trees of up to N tokens (--gamma caps the depth); 0: chains")
    p.add_argument("--ngram-min", type=positive_int, default=1)
    p.add_argument("--ngram-max", type=positive_int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--policy", default=None, help="take method and γ from this policy file")
    p.add_argument("--turn-type", default="chat", help="turn type the policy decides for")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    add_engine_args(p)
    p.set_defaults(func=run)


def _messages(args: argparse.Namespace) -> list[dict]:
    if args.prompt is not None:
        return [{"role": "user", "content": args.prompt}]
    try:
        messages = json.loads(Path(args.messages_file).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: --messages-file: {exc}") from exc
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise SystemExit("error: --messages-file must hold a JSON list of messages with a 'role'")
    return messages


def run(args: argparse.Namespace) -> int:
    from openalice_runner.engine import SamplingParams, SpecConfig

    messages = _messages(args)
    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))
        spec = SpecConfig(method=args.spec, gamma=args.gamma, draft_layers=args.draft_layers,
                          ngram_min=args.ngram_min, ngram_max=args.ngram_max, eagle_head=args.eagle_head,
                          eagle_lookup=args.eagle_lookup, eagle_tree=args.eagle_tree)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    store = load_policy(args.policy)
    decision = None
    if store is not None:
        from openalice_runner.policies import RequestContext

        decision = store.decide(RequestContext(turn_type=args.turn_type, batch_size=1, provider="local"))
        spec = SpecConfig.from_plan(decision)
    engine = load_engine(args)
    prompt = engine.render_chat(messages)
    if args.json:
        result = engine.generate(prompt, sampling, spec)
    else:
        result = None
        for event in engine.stream(prompt, sampling, spec):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            result = event.result or result
        sys.stdout.write("\n")
    if decision is not None:
        result.stats.rule, result.stats.policy_version = str(decision.rule), decision.policy_version
        store.observe(args.turn_type, decision.method, "local", result.stats.outcome())
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict()}))
    else:
        s = result.stats
        print(f"[{s.method} γ={s.gamma}: {s.completion_tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
              f"ttft {s.ttft_s * 1000:.0f} ms, acceptance {s.acceptance_rate:.2f}, "
              f"{s.tokens_per_pass:.2f} tokens/pass, finish {s.finish_reason}]", file=sys.stderr)
    return 0

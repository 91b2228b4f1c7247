"""Run by the vLLM side venv's python (tests/policies/test_vllm_flags.py): parse each server command line with
vLLM 0.32's own API-server parser, validate it as the server does before loading, and build the
engine config (SpeculativeConfig included, and the per-batch table's dense lookup as the scheduler
builds it). stdin: {"lines": [[flag, ...], ...]}; stdout, last line: {"results": [...]}."""

import json
import sys

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

results = []
for args in json.load(sys.stdin)["lines"]:
    try:
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
        validate_parsed_serve_args(ns)
        config = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
        spec = config.speculative_config
        out = {
            "ok": True,
            "served_model_name": ns.served_model_name,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "enable_prefix_caching": config.cache_config.enable_prefix_caching,
            "enable_auto_tool_choice": ns.enable_auto_tool_choice,
            "tool_call_parser": ns.tool_call_parser,
            "chat_template": ns.chat_template,
            "per_request_spec_decode_metrics": config.observability_config.per_request_spec_decode_metrics,
            "spec": None,
        }
        if spec is not None:
            table = spec.num_speculative_tokens_per_batch_size
            out["spec"] = {
                "method": spec.method,
                "num_speculative_tokens": spec.num_speculative_tokens,
                "prompt_lookup_min": spec.prompt_lookup_min,
                "prompt_lookup_max": spec.prompt_lookup_max,
                "model": spec.model,
                "draft_architectures": list(spec.draft_model_config.architectures or [])
                if spec.draft_model_config is not None else None,
                "table": [list(r) for r in table] if table else None,
                "dense": build_dynamic_sd_schedule_lookup(
                    table, config.scheduler_config.max_num_seqs, spec.num_speculative_tokens
                ) if table else None,
            }
    except BaseException as exc:  # noqa: BLE001  argparse exits; report what vLLM said
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    results.append(out)
print(json.dumps({"results": results}))

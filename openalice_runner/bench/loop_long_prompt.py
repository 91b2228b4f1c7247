"""`bench-loops --long-prompt`: the rate each target prefills one long prompt, timed in the same run
as the loops (issue 49: a loop's later calls prefill 100-700 new tokens on a cached prefix; their
rate is held against this one, measured side by side rather than in another run).

Per repeat, before its conversations, each target answers one call of about LONG_PROMPT_TOKENS
prompt tokens (the source of a standard-library module) and max_tokens 1, its first line naming the
repeat so that no repeat finds another's prompt in a cache. Timed and summed as the loops' calls
are (loop_first_token.py): the new prompt tokens' rate over the time to the first token, and over
the prefill's passes where the server reports its `first_token` breakdown."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

from openalice_runner.bench.loop_call import Target, stream_call
from openalice_runner.bench.loop_workload import Call

LONG_PROMPT_TOKENS = 1200  # the issue's long prompt (SmolLM2's tokenizer: about 3.3 characters a token of code)
CHARS_PER_TOKEN = 3.3
TURN_TYPE = "summarize"


def long_prompt(run: int, tokens: int = LONG_PROMPT_TOKENS) -> list[dict[str, Any]]:
    """The probe's messages for repeat `run`: a line naming it, then source code to summarise."""
    source = inspect.getsource(textwrap)[: int(tokens * CHARS_PER_TOKEN)]
    return [{"role": "user", "content": f"Probe {run}.\nSummarise this module:\n{source}"}]


def probe(client, target: Target, run: int) -> dict[str, Any]:
    """One long-prompt call to `target`, as the loops' calls are recorded."""
    call = Call(turn_type=TURN_TYPE, max_tokens=1)
    headers = {"X-OpenAlice-Turn-Type": TURN_TYPE} if target.stated else {}
    record = stream_call(client, target, long_prompt(run), [], call, headers)
    return record.as_json()

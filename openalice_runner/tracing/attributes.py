"""Span, attribute and metric names in one place.

GenAI names follow the OpenTelemetry GenAI semantic conventions (open-telemetry/semantic-conventions-genai,
docs/gen-ai/gen-ai-spans.md, gen-ai-agent-spans.md, gen-ai-metrics.md; status: Development). They are
spelled out here rather than imported from `opentelemetry.semconv._incubating`, whose GenAI constants are
deprecated there since the conventions moved to their own repository.
Our own figures live under `openalice.`.
"""

from __future__ import annotations

# --- GenAI semantic conventions: attributes -------------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
# of those, served from the KV cache (prefix reuse) instead of being prefilled
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE = "gen_ai.tool.type"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
# Opt-in content (only with record_content=True): JSON strings, as the conventions allow on spans.
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT = "gen_ai.tool.call.result"
ERROR_TYPE = "error.type"  # stable general attribute

# gen_ai.operation.name values
OP_CHAT = "chat"
OP_INVOKE_AGENT = "invoke_agent"
OP_EXECUTE_TOOL = "execute_tool"

# --- GenAI semantic conventions: metrics -----------------------------------------------------------
METRIC_OPERATION_DURATION = "gen_ai.client.operation.duration"  # s
METRIC_TOKEN_USAGE = "gen_ai.client.token.usage"  # {token}
METRIC_TIME_TO_FIRST_CHUNK = "gen_ai.client.operation.time_to_first_chunk"  # s
METRIC_INVOKE_AGENT_DURATION = "gen_ai.invoke_agent.duration"  # s
METRIC_EXECUTE_TOOL_DURATION = "gen_ai.execute_tool.duration"  # s
# Bucket boundaries the conventions recommend.
DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)

# --- openalice-runner's own ----------------------------------------------------------------------
TURN_TYPE = "openalice.turn.type"
TURN_TYPE_SOURCE = "openalice.turn.type.source"  # stated (X-OpenAlice-* / metadata) | inferred | default
TURN_TYPE_INFERRED_BY = "openalice.turn.type.inferred_by"  # the inference table's row (server/turn_inference.py)
CONVERSATION_SOURCE = "openalice.conversation.source"  # stated | inferred (a session key the wire sent)
CONVERSATION_INFERRED_FROM = "openalice.conversation.inferred_from"  # that key: prompt_cache_key, a header, ...
STEP = "openalice.step"
TENANT = "openalice.tenant"  # the tenant a request's key names (`serve --keys`; server/tenants/)
PROVIDER = "openalice.provider"  # our provider entry's name (local, sglang-eagle, hosted-...)
POOL = "openalice.pool"  # SGLang server pool, when routed to one
SPEC_METHOD = "openalice.speculation.method"
SPEC_GAMMA = "openalice.speculation.gamma"
SPEC_RULE = "openalice.speculation.rule"
SPEC_REASON = "openalice.speculation.reason"
SPEC_POLICY_VERSION = "openalice.speculation.policy_version"
SPEC_PROPOSED = "openalice.speculation.proposed"
SPEC_ACCEPTED = "openalice.speculation.accepted"
SPEC_ACCEPTANCE_RATE = "openalice.speculation.acceptance_rate"
SPEC_TARGET_PASSES = "openalice.speculation.target_passes"
SPEC_TOKENS_PER_PASS = "openalice.speculation.tokens_per_pass"
LATENCY_QUEUE_MS = "openalice.latency.queue_ms"
LATENCY_TTFT_MS = "openalice.latency.ttft_ms"
LATENCY_DECODE_MS = "openalice.latency.decode_ms"
LATENCY_DRAFT_MS = "openalice.latency.draft_ms"
LATENCY_VERIFY_MS = "openalice.latency.verify_ms"
TOKENS_PER_SECOND = "openalice.tokens_per_second"
# the time before the first token by part (first_token.py PARTS): `{LATENCY_FIRST_TOKEN}.{part}_ms`, and
# `.total_ms` their sum; each prefill pass as an event on the call span, its tokens and ms
LATENCY_FIRST_TOKEN = "openalice.latency.first_token"
EVENT_PREFILL_CHUNK = "openalice.prefill.chunk"
PREFILL_CHUNK_INDEX = "openalice.prefill.chunk.index"
PREFILL_CHUNK_TOKENS = "openalice.prefill.chunk.tokens"
PREFILL_CHUNK_MS = "openalice.prefill.chunk.ms"
TURN_STEPS = "openalice.turn.steps"  # model calls the turn held, set when it ends
TURN_END_REASON = "openalice.turn.end_reason"  # server-tracked turns: final_answer | error | idle | shutdown

METRIC_ACCEPTED_DRAFTS_PER_ROUND = "openalice.speculation.accepted_drafts_per_round"  # {token}: tokens_per_pass − 1
METRIC_TOKENS_PER_SECOND = "openalice.generation.tokens_per_second"  # {token}/s
ACCEPTED_DRAFTS_PER_ROUND_BUCKETS = tuple(range(0, 17))
TOKENS_PER_SECOND_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)

"""OpenAI's Responses API (`POST /v1/responses`, what Codex speaks) as a thin translation onto the chat
request the sidecar already runs.

- schema.py: the request body, field for field as OpenAI's API reference and `openai` SDK types have it;
- translate.py: that body (and a stored earlier response) -> a ServerChatRequest;
- reply.py: a ChatResult -> the Response object; errors in OpenAI's shape;
- events.py: ChatChunks -> the Responses stream events (`response.created` ... `response.completed`);
- store.py: recent responses, per API key, for `previous_response_id`.
"""

"""The grammar a local reply must follow, from tool_choice and response_format.

Tool calls take the fallback format (<tool_call> blocks, also what tool-rendering Hermes templates use).
The grammar text and its compiling are the engine's (engine/grammar.py), reached through a
`GrammarBackend` that providers/local.py hands in: only local.py imports the engine."""

from __future__ import annotations

from typing import Any, Protocol

from openalice_runner.providers.base import ProviderBadRequest
from openalice_runner.providers.embedded import tool_format
from openalice_runner.types import ChatRequest, NamedToolChoice


class GrammarBackend(Protocol):
    """What building a reply's grammar needs of the engine."""

    @property
    def error(self) -> type[Exception]:
        """The backend's refusal of a grammar (engine/grammar.py's GrammarError: param, code)."""
        ...

    def compile(self, text: str) -> Any:
        """The compiled Grammar (it has `after(token_ids)`, the grammar past a prefill)."""
        ...

    def json_grammar(self, schema: dict[str, Any] | None) -> str: ...

    def tool_call_grammar(
        self,
        tools: list[dict[str, Any]],
        mode: str,
        parallel: bool = True,
        content_schema: dict[str, Any] | None = None,
        content_json: bool = False,
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...


def reply_grammar(
    request: ChatRequest, tools: list[dict[str, Any]] | None, choice: Any, backend: GrammarBackend, provider: str
) -> Any:
    """The grammar for tool_choice and response_format (None: the reply is free text).

    "required" one or more calls (one without parallel_tool_calls), a named function that call,
    "auto" a reply without calls or text followed by calls; the reply without calls is JSON where
    response_format asks for it; "none" a reply without calls. `tools`: the callable ones
    (allowed_tools' subset)."""
    fmt = request.response_format
    content_json = fmt is not None and fmt.type != "text"
    schema = fmt.json_schema.schema_ if fmt is not None and fmt.json_schema is not None else None
    parallel = request.parallel_tool_calls is not False
    fmt_param = "response_format.json_schema.schema" if schema is not None else "response_format"
    if tools and choice == "none":
        text = backend.json_grammar(schema) if content_json else backend.tool_call_grammar(tools, "none")
        param = fmt_param if content_json else "tools"
    elif tools:
        if isinstance(choice, NamedToolChoice):
            chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
            text = backend.tool_call_grammar(chosen, "required", parallel=False)
        else:
            text = backend.tool_call_grammar(tools, choice, parallel, content_schema=schema, content_json=content_json)
        param = "tools"
    elif content_json:
        text, param = backend.json_grammar(schema), fmt_param
    else:
        return None
    try:
        return backend.compile(text)
    except backend.error as exc:
        if param == "tools" and getattr(exc, "code", None) != "grammar_timeout":  # each tool could time out too
            param = refused_tool(tools or [], request, backend) or param
        raise ProviderBadRequest(f"{param}: the grammar backend refused the schema: {exc}", provider=provider,
                                 param=param, code=getattr(exc, "code", None) or "invalid_value") from exc


def refused_tool(tools: list[dict[str, Any]], request: ChatRequest, backend: GrammarBackend) -> str | None:
    """The field whose schema the grammar backend refuses (each compiled alone)."""
    for i, tool in enumerate(tools):
        try:
            backend.compile(backend.json_grammar(tool["function"].get("parameters")))
        except backend.error:
            names = [t.function.name for t in request.tools or ()]
            index = names.index(tool["function"]["name"]) if tool["function"]["name"] in names else i
            return f"tools[{index}].function.parameters"
    if request.response_format is not None and request.response_format.json_schema is not None:
        return "response_format.json_schema.schema"
    return None


def prefill_within(grammar: Any, prefill: str, choice: Any, backend: GrammarBackend) -> tuple[str, Any]:
    """The prefill and the grammar after it; where the grammar does not allow the argument
    opening (it writes the schema's properties in their order), the call's opening alone."""
    for text in (prefill, tool_format.assistant_prefill(choice)):
        try:
            return text, grammar.after(backend.encode(text))
        except backend.error:
            continue
    return "", grammar

"""A request's tools, its tool_choice forms and its response_format, each JSON Schema checked."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    field_validator,
    model_validator,
)

from openalice_runner.config_files.models import StrictModel
from openalice_runner.types.messages import (
    FunctionName,
)


def check_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` itself valid against its JSON Schema meta-schema (draft 2020-12 unless `$schema`
    names another); ValueError naming the first problem."""
    import jsonschema

    from openalice_runner.schema_limits import check_refs, check_schema_limits, known_valid, remember_valid

    check_schema_limits(schema)  # before jsonschema's check, which recurses
    # An agent loop sends the same tools on every call, and the meta-schema check costs ~1 ms a tool.
    digest = known_valid(schema)
    if digest is None:
        return schema
    check_refs(schema)  # before the grammar compiler, which follows them recursively in native code
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else "")) from None
    remember_valid(digest)
    return schema


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_is_object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type", "object") != "object":
            raise ValueError("parameters must be a JSON schema of type 'object'")
        return check_json_schema(v)


class ToolDefinition(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    @property
    def name(self) -> str:
        return self.function.name


class NamedFunction(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class AllowedTools(StrictModel):
    """Which offered tools the model may call, and whether it must call one ("required") or may
    answer instead ("auto")."""

    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.tools]


class AllowedToolChoice(StrictModel):
    """OpenAI's `{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`: every tool is
    still offered (the prompt stays the same, so it caches), but only these may be called."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def _tool_choice_form(value: Any) -> str:
    """Which form a tool_choice is, so it is validated as that form alone and its errors name that
    form's fields (the tags are member names the sidecar leaves out of an error's field path)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind == "allowed_tools":
        return "AllowedToolChoice"
    return "NamedToolChoice" if isinstance(value, (dict, BaseModel)) else "str"


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[NamedToolChoice, Tag("NamedToolChoice")]
    | Annotated[AllowedToolChoice, Tag("AllowedToolChoice")],
    Discriminator(_tool_choice_form),
]




class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`: the reply is one JSON value of `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    # `schema` shadows a BaseModel attribute: stored as schema_, read and written as "schema"
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_json_schema(v)


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: "text" (free), "json_object" (any JSON object) or "json_schema"
    (one JSON value of `json_schema.schema`). Another type is refused, naming response_format.type."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_fits_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only allowed with type 'json_schema', not {self.type!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's JSON (the schema under "schema")."""
        return self.model_dump(by_alias=True, exclude_none=True)

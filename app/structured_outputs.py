"""The request fields that constrain what a request may generate, and the one engine constraint they become.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` and its older
`guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`, and the schema that `tool_choice`
`required` or a named function decodes under (app/tool_calls/plan.py) all become
`SamplingParams.structured_outputs` (engine/config.py), which the engine compiles and masks every step with.
A request may send one of them: two constraints are a 400. A 400 about the constraint (one that does not
compile, say) names the field the client sent it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.config import StructuredOutputsParams
from engine.errors import InvalidRequestError

# a request's parts are strict (app/protocol.py): `"strict": 1` is refused, as OpenAI refuses it
REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)
# vLLM's older top-level fields, and the StructuredOutputsParams field each one sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # left out: any JSON object
    strict: bool | None = None  # the schema is always enforced, strict or not


class TextFormat(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputsRequest(StructuredOutputsParams):
    """vLLM's `structured_outputs` request field: the engine's StructuredOutputsParams, strictly typed."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True)


@dataclass(frozen=True)
class OutputConstraint:
    params: StructuredOutputsParams
    field: str  # the request field it came from: what a 400 about it names


def output_constraint(req, tool_schema: dict | None = None) -> OutputConstraint | None:
    """The one constraint that a completion or chat request sends (`tool_schema`: the one its tool_choice
    makes), or None. Raises InvalidRequestError for two constraints, or for one that is malformed."""
    found: list[tuple[str, dict]] = []
    response_format = req.response_format
    if isinstance(response_format, JsonObjectFormat):
        found.append(("response_format", {"json_object": True}))
    elif isinstance(response_format, JsonSchemaFormat):
        schema = response_format.json_schema.schema_
        found.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", req.structured_outputs.model_dump(exclude_defaults=True, by_alias=True)))
    found += [(name, {kind: getattr(req, name)}) for name, kind in GUIDED_FIELDS.items()
              if getattr(req, name) is not None]
    if tool_schema is not None:
        found.append(("tools", {"json": tool_schema}))
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(f"`{name}`" for name, _ in found)
        raise InvalidRequestError(f"{names} each constrain the output: send one of them.", param=found[1][0])
    field, fields = found[0]
    try:
        return OutputConstraint(StructuredOutputsParams(**fields), field)
    except InvalidRequestError as e:
        raise InvalidRequestError(e.message, param=field) from None


def named_for_the_request(e: InvalidRequestError, constraint: OutputConstraint | None) -> InvalidRequestError:
    """The engine's error about a constraint (param `structured_outputs`), naming the field the client used."""
    if constraint is None or e.param != "structured_outputs" or constraint.field == "structured_outputs":
        return e
    return InvalidRequestError(e.message, param=constraint.field)

"""Structured outputs: a request's output constraint -> the worker's StructuredOutputs.

A request names at most one constraint, in one of these fields (OpenAI's, then vLLM's):
`response_format` (`json_object`, or `json_schema` with `strict`; `text` is no constraint),
`structured_outputs` ({json | regex | choice | grammar | json_object}), or the older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. More than one is a 400
naming them. What can be checked without the engine is checked here (a JSON schema against
its metaschema, a choice list, a grammar that is not blank); the engine's backend (xgrammar,
falling back to guidance) compiles the rest in the worker, which answers InvalidRequest
naming `structured_outputs` -- `Prepared.constraint_param` names the client's field then.

Regexes are left to the worker: the backends' dialect is not Python's (they accept `\\p{L}`
and `(?<name>...)`, which `re` refuses).

`strict` in `json_schema`: true and false both constrain the output to the schema (vLLM's
behaviour; xgrammar's strict mode also never adds properties the schema does not name), so
strict's promise holds either way and strict: false gets more than "best effort".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from turbine.frontend.errors import RequestError
from turbine.protocol.generate import StructuredOutputs

# As vLLM (MAX_STRUCTURED_OUTPUT_JSON_NESTING): deeper schemas cost the backend too much to
# convert (OpenAI allows 10); also keeps the metaschema check's recursion bounded.
MAX_SCHEMA_NESTING = 64

# The engine's error for a constraint names this GenerateRequest field.
WORKER_PARAM = "structured_outputs"


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # both values constrain (module docstring)


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # text | json_object | json_schema; others (vLLM's structural tags) are refused
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` request field, the constraints Turbine serves. Its other
    options (per-request whitespace, additional-properties and backend settings, structural
    tags) are refused as unknown fields: vLLM's backends read them from the engine's config
    only, so they would be accepted and ignored."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ConstraintFields(msgspec.Struct, kw_only=True):
    """The request fields that constrain the output; both request kinds have them."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM v1 has one backend per engine: a per-request choice cannot be honoured.
    guided_decoding_backend: str | None = None


@dataclass(frozen=True, slots=True)
class Constraint:
    outputs: StructuredOutputs
    param: str  # the request field it came from, named in errors


def constraint_of(req: ConstraintFields) -> Constraint | None:
    """The request's output constraint, checked; None when the output is free text.
    Raises RequestError naming the field."""
    if req.guided_decoding_backend is not None:
        raise RequestError("guided_decoding_backend: the structured-output backend is chosen per engine "
                           "(vLLM's --structured-outputs-config), not per request", param="guided_decoding_backend")
    found: list[Constraint] = []
    if req.response_format is not None:
        rf = req.response_format
        if rf.type == "json_object":
            found.append(Constraint(StructuredOutputs(json_object=True), "response_format"))
        elif rf.type == "json_schema":
            if rf.json_schema is None:
                raise RequestError("response_format: type json_schema needs a json_schema",
                                   param="response_format.json_schema")
            if rf.json_schema.schema is None:
                raise RequestError("response_format.json_schema.schema is required",
                                   param="response_format.json_schema.schema")
            found.append(Constraint(json_schema_constraint(rf.json_schema.schema, "response_format.json_schema.schema"),
                                    "response_format"))
        elif rf.type != "text":
            raise RequestError(f"response_format.type {rf.type!r} is not supported: use text, json_object or "
                               "json_schema", param="response_format.type")
    if req.structured_outputs is not None:
        so = req.structured_outputs
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(so, k) is not None]
        if len(kinds) != 1:
            raise RequestError(f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object "
                               f"(got {', '.join(kinds) or 'none'})", param="structured_outputs")
        kind = kinds[0]
        found.append(Constraint(_one(kind, getattr(so, kind), f"structured_outputs.{kind}"), "structured_outputs"))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append(Constraint(_one(kind, value, f"guided_{kind}"), f"guided_{kind}"))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise RequestError(f"only one output constraint may be given; got {names}", param=found[1].param)
    return found[0] if found else None


def json_schema_constraint(schema: Any, param: str) -> StructuredOutputs:
    """A JSON schema (a dict, or its JSON text) checked against its metaschema, as the
    constraint that makes the output validate against it. `param` is the request field
    named in errors (e.g. "tools[0].function.parameters")."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise RequestError(f"{param}: not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: a JSON schema must be an object", param=param)
    if _nesting_exceeds(schema, MAX_SCHEMA_NESTING):
        raise RequestError(f"{param}: the schema nests objects and arrays more than {MAX_SCHEMA_NESTING} levels",
                           param=param)
    import jsonschema  # here, not at the top: ~0.25 s of every frontend start, needed only by such a request

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise RequestError(f"{param}: not a valid JSON schema{f' at {where}' if where else ''}: {exc.message}",
                           param=param) from None
    return StructuredOutputs(json=json.dumps(schema))


def _one(kind: str, value: Any, param: str) -> StructuredOutputs:
    if kind == "json":
        return json_schema_constraint(value, param)
    if kind == "json_object":
        if value is not True:
            raise RequestError(f"{param} must be true if given", param=param)
        return StructuredOutputs(json_object=True)
    if kind == "choice":
        if not value:
            raise RequestError(f"{param}: must be a non-empty list of strings", param=param)
        return StructuredOutputs(choice=list(value))
    if kind == "grammar":
        if not value.strip():
            raise RequestError(f"{param}: the grammar is empty", param=param)
        return StructuredOutputs(grammar=value)
    if "\x00" in value:  # regex: the backends' parsers do not take NUL
        raise RequestError(f"{param}: the regex contains a NUL character", param=param)
    return StructuredOutputs(regex=value)


def _nesting_exceeds(doc: Any, limit: int) -> bool:
    level = [doc]
    for _ in range(limit):
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return True

"""Structured outputs in the frontend: each request field becomes the worker's StructuredOutputs,
bad ones are a 400 naming the field, and a disaggregated request's prefill gets the constraint."""

from __future__ import annotations

import json

import pytest

from tests.unit.frontend.dispatch.test_frontend_disagg import Workers, model_with, req, run
from turbine.frontend.errors import RequestError, failure_of
from turbine.frontend.preprocess.schemas import ChatCompletionRequest, CompletionRequest, decode_request
from turbine.frontend.preprocess.structured import constraint_of, json_schema_constraint
from turbine.protocol.generate import GenerateOutput, StructuredOutputs
from turbine.runtime.errors import InvalidRequest, RemoteError
from turbine.runtime.request_plane import RequestPlaneClient

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["city", "n"], "additionalProperties": False}


def constraint(kind=ChatCompletionRequest, **fields):
    body = {"model": "m", **fields}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if kind is ChatCompletionRequest else {"prompt": "p"})
    return constraint_of(decode_request(json.dumps(body).encode(), kind))


def refused(**fields) -> RequestError:
    with pytest.raises(RequestError) as info:
        constraint(**fields)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("kind", [ChatCompletionRequest, CompletionRequest])
def test_each_field_becomes_one_constraint(kind):
    schema_text = json.dumps(SCHEMA)
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         StructuredOutputs(json=schema_text), "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": False}}},
         StructuredOutputs(json=schema_text), "response_format"),  # strict: false constrains too
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True), "response_format"),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs(json=schema_text), "structured_outputs"),
        ({"structured_outputs": {"json": schema_text}}, StructuredOutputs(json=schema_text), "structured_outputs"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputs(regex="[a-z]+"), "structured_outputs"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs(choice=["yes", "no"]),
         "structured_outputs"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputs(grammar='root ::= "a"'),
         "structured_outputs"),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True), "structured_outputs"),
        ({"guided_json": SCHEMA}, StructuredOutputs(json=schema_text), "guided_json"),
        ({"guided_regex": r"\d+"}, StructuredOutputs(regex=r"\d+"), "guided_regex"),
        ({"guided_choice": ["a", "b"]}, StructuredOutputs(choice=["a", "b"]), "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputs(grammar='root ::= "a"'), "guided_grammar"),
    ]
    for fields, outputs, param in cases:
        got = constraint(kind, **fields)
        assert got.outputs == outputs and got.param == param, fields


def test_text_and_nothing_are_free_text():
    assert constraint() is None
    assert constraint(response_format={"type": "text"}) is None
    # text is no constraint, so it goes with one
    assert constraint(response_format={"type": "text"}, guided_regex="a").param == "guided_regex"


def test_more_than_one_constraint_names_the_fields():
    err = refused(response_format={"type": "json_object"}, guided_regex="a+")
    assert "response_format" in err.message and "guided_regex" in err.message and err.param == "guided_regex"
    err = refused(structured_outputs={"choice": ["a"]}, guided_choice=["b"])
    assert err.param == "guided_choice" and "structured_outputs" in err.message
    err = refused(structured_outputs={"regex": "a", "choice": ["a"]})
    assert err.param == "structured_outputs" and "regex, choice" in err.message
    assert refused(structured_outputs={}).param == "structured_outputs"


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"properties": {"a": {"minLength": -1}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format.extra"),
    ({"guided_json": {"type": "bogus"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a\x00"}}, "structured_outputs.regex"),
    # per-request options vLLM's backends would ignore: refused, not accepted
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_bad_constraints_name_the_field(fields, param):
    assert refused(**fields).param == param


def test_schema_nested_too_deep_is_refused_before_the_metaschema_check():
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "array", "items": schema}
    with pytest.raises(RequestError, match="nests") as info:
        json_schema_constraint(schema, "tools[0].function.parameters")
    assert info.value.param == "tools[0].function.parameters"


def test_json_schema_constraint_is_public_for_forced_tool_calls():
    params = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    assert json_schema_constraint(params, "tools[0].function.parameters") == StructuredOutputs(json=json.dumps(params))


async def test_a_workers_refusal_of_the_constraint_names_its_field_across_the_request_plane(tokenizer):
    async def refuses(req, ctx):
        raise InvalidRequest("Grammar error: Unimplemented keys", param="structured_outputs")
        yield

    w = Workers(tokenizer)
    client = RequestPlaneClient(connect_timeout=1.0)
    try:
        address = await w.serve(refuses)
        with pytest.raises(RemoteError) as info:
            async for _ in client.stream(address, "generate", req(), GenerateOutput):
                pass
    finally:
        await client.close()
        await w.stop()
    err = failure_of(info.value)
    assert err.status == 400 and err.param == "structured_outputs"  # http names Prepared.constraint_param then


async def test_the_prefill_worker_gets_the_same_constraint(tokenizer):
    w = Workers(tokenizer)
    outputs = StructuredOutputs(json=json.dumps(SCHEMA))
    try:
        model = model_with(tokenizer, await w.serve(w.decode), [await w.serve(w.prefill)])
        request = req()
        request.structured_outputs = outputs
        await run(model, request)
        (p,) = w.prefill_calls
        (d,) = w.decode_calls
        assert p.stop.max_tokens == 1 and p.structured_outputs == outputs
        assert d.structured_outputs == outputs
    finally:
        await w.stop()

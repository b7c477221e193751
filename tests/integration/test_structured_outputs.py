"""Structured outputs end to end: the official openai client, the real frontend and real vLLM
CPU workers (the shared `cluster`). The engine constrains the output, so even SmolLM2-135M
answers in the shape asked for; a constraint the backend cannot compile is a 400 naming the
field, and the server keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import MODEL

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["city", "n"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Name a city and a number, as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


def test_json_schema_output_validates(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                       response_format=RESPONSE_FORMAT)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_schema_output_validates_streamed(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0.8, seed=3,
                                            response_format=RESPONSE_FORMAT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_parses(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":  # any object is allowed, so it may not end within max_tokens
        assert isinstance(json.loads(content), dict)
    else:
        assert content.lstrip().startswith("{")


@pytest.mark.parametrize("extra", [{"guided_regex": "[a-z]{3,8}"}, {"structured_outputs": {"regex": "[a-z]{3,8}"}}])
def test_regex_output_matches(client, extra):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, extra_body=extra)
    assert re.fullmatch("[a-z]{3,8}", r.choices[0].message.content)


def test_choice_output_is_one_of_the_choices(client):
    choices = ["Paris", "London", "Tokyo"]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A city?"}],
                                       max_tokens=8, extra_body={"guided_choice": choices})
    assert r.choices[0].message.content in choices
    c = client.completions.create(model=MODEL, prompt="The best city is", max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": choices}})
    assert c.choices[0].text in choices


class City(BaseModel):
    city: str = Field(max_length=12)
    n: int = Field(ge=0, le=999)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=40, temperature=0, response_format=City)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and len(parsed.city) <= 12


@pytest.mark.parametrize("kwargs,param", [
    # passes the metaschema, but the backend (xgrammar, then guidance) cannot compile it: refused by the worker
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format"),
    ({"extra_body": {"guided_json": {"$ref": "#/$defs/missing"}}}, "guided_json"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}}, "structured_outputs"),
    ({"extra_body": {"guided_regex": "a("}}, "guided_regex"),
    # refused by the frontend
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_cannot_compile_is_a_400_naming_the_field(client, kwargs, param, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, stream=stream, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    # the workers keep serving
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")

"""The frontend's /v1/embeddings before and after the worker: the body's checks and the two
encodings (the worker path end to end: tests/integration/test_embeddings.py)."""

from __future__ import annotations

import array
import base64

import msgspec
import pytest

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from turbine.frontend.apis.embeddings import _encoded, embeddings
from turbine.frontend.errors import RequestError
from turbine.frontend.models.table import ModelTable


def table(tokenizer, types=("embeddings",)) -> ModelTable:
    models = ModelTable(registry=None, make_router=None)
    model = served(tokenizer, [instance("w", "127.0.0.1:1")])  # context length 2048
    model.card.endpoint_types = list(types)
    models.models["m"] = model
    return models


@pytest.mark.parametrize("fields,param,words", [
    ({"input": "hi", "dimensions": 8}, "dimensions", "not supported"),
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "must be"),
    ({"input": [1, "a"]}, "input", "must be"),
    ({"input": [[1], [True]]}, "input", "must be"),
    ({"input": [10**9]}, "input", "vocabulary"),
    ({"input": [1] * 2049}, "input", "context length"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({}, "input", ""),
])
async def test_bad_bodies_get_a_named_400(tokenizer, fields, param, words):
    with pytest.raises(RequestError) as info:
        await embeddings(msgspec.json.encode({"model": "m", **fields}), table(tokenizer), client=None)
    assert (info.value.status, info.value.param) == (400, param) and words in info.value.message


async def test_a_model_that_generates_serves_no_embeddings(tokenizer):
    with pytest.raises(RequestError, match="does not serve embeddings") as info:
        await embeddings(b'{"model": "m", "input": "hi"}', table(tokenizer, ("chat", "completions")), client=None)
    assert info.value.param == "model"


def test_float_and_base64_encodings_carry_the_same_float32_values():
    values = [0.5, -1.25, 3.0e-8]
    raw = array.array("f", values).tobytes()  # what the worker sends (little-endian here)
    assert _encoded(raw, "float") == pytest.approx(values)
    assert base64.b64decode(_encoded(raw, "base64")) == raw

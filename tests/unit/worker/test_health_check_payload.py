"""The health check's payload (turbine/worker/health_check.py): the default per mode with the tokenizer's
own BOS token, the operator's payload from --health-check-payload / TURBINE_HEALTH_CHECK_PAYLOAD (JSON
or @file), and a payload that cannot be a request refused at start naming the flag (exit 2)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from turbine.mocker.args import parse_mocker_args
from turbine.protocol.generate import TextInput
from turbine.worker import health_check
from turbine.worker.health_check import PayloadError


def test_bos_comes_from_the_tokenizer(model_dir):
    assert health_check.bos_token_id(AutoTokenizer.from_pretrained(model_dir)) == 1  # SmolLM2's <|im_start|>
    other = AutoTokenizer.from_pretrained(model_dir, bos_token="<|im_end|>")
    assert health_check.bos_token_id(other) == 2
    req = health_check.generate_request(None, bos=health_check.bos_token_id(other), text_mode=False)
    assert req.token_ids == [2] and req.stop.max_tokens == 1 and req.sampling.temperature == 0.0
    from tokenizers import Tokenizer  # the fast tokenizer alone has no BOS notion: Dynamo's default

    assert health_check.bos_token_id(Tokenizer.from_file(f"{model_dir}/tokenizer.json")) == health_check.DEFAULT_BOS


def test_the_default_of_each_mode():
    tokens = health_check.generate_request(None, bos=7, text_mode=False, dp_rank=1)
    assert (tokens.token_ids, tokens.text, tokens.dp_rank) == ([7], None, 1)
    text = health_check.generate_request(None, bos=7, text_mode=True)
    assert text.token_ids == [] and text.text == TextInput(prompt=health_check.TEXT_PROMPT)
    embed = health_check.embed_request(None, bos=7)
    assert embed.inputs == [[7]]
    assert tokens.request_id.startswith("canary-") and tokens.request_id != text.request_id


def test_a_payload_replaces_the_default(tmp_path):
    payload = health_check.read_payload('{"token_ids": [5, 6], "stop": {"max_tokens": 2}}')
    req = health_check.generate_request(payload, bos=1, text_mode=False, dp_rank=0)
    assert (req.token_ids, req.stop.max_tokens, req.dp_rank) == ([5, 6], 2, 0)
    path = tmp_path / "payload.json"
    path.write_text(json.dumps({"inputs": [[3, 4]]}))
    assert health_check.embed_request(health_check.read_payload(f"@{path}"), bos=1).inputs == [[3, 4]]
    text = health_check.generate_request(health_check.read_payload('{"text": {"prompt": "ping"}}'), bos=1,
                                         text_mode=True)
    assert text.text.prompt == "ping"


@pytest.mark.parametrize("value,words", [
    ("{nope", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"tokens": [1]}', "unknown field(s) tokens"),
    ('{"request_id": "x"}', "'request_id' is the worker's own"),
    ("@/no/such/file", "cannot read it"),
])
def test_a_payload_that_cannot_be_a_request_is_named(value, words):
    with pytest.raises(PayloadError, match=words.replace("(", r"\(").replace(")", r"\)")):
        health_check.read_payload(value)


def test_a_payload_of_the_wrong_kind_or_types_is_refused_when_used():
    with pytest.raises(PayloadError, match="inputs: not a field of a generate request"):
        health_check.generate_request({"inputs": [[1]]}, bos=1, text_mode=False)
    with pytest.raises(PayloadError, match="token_ids: not a field of an embed request"):
        health_check.embed_request({"token_ids": [1]}, bos=1)
    with pytest.raises(PayloadError, match=r"Expected `array`, got `str` - at `\$.token_ids`"):
        health_check.generate_request({"token_ids": "abc"}, bos=1, text_mode=False)


def test_the_flag_and_its_environment_variable(tmp_path, monkeypatch, capsys):
    assert parse_mocker_args(["--health-check-payload", '{"token_ids": [9]}']).health_check_payload == {
        "token_ids": [9]}
    path = tmp_path / "p.json"
    path.write_text('{"token_ids": [8]}')
    monkeypatch.setenv("TURBINE_HEALTH_CHECK_PAYLOAD", f"@{path}")
    assert parse_mocker_args([]).health_check_payload == {"token_ids": [8]}
    monkeypatch.setenv("TURBINE_HEALTH_CHECK_PAYLOAD", '{"tokens": [1]}')
    with pytest.raises(SystemExit) as info:
        parse_mocker_args([])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--health-check-payload (or TURBINE_HEALTH_CHECK_PAYLOAD): unknown field(s) tokens" in err

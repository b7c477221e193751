"""The mocker has no tokenizer to work in text mode: it refuses the flag and text requests by name."""

from __future__ import annotations

import pytest

from tests.unit.mocker.test_mocker_engine import collect, worker
from turbine.mocker.args import parse_mocker_args
from turbine.protocol.generate import GenerateRequest, TextInput
from turbine.runtime.errors import InvalidRequest


def test_the_text_mode_flag_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        parse_mocker_args(["--use-vllm-tokenizer"])
    assert info.value.code == 2 and "--use-vllm-tokenizer" in capsys.readouterr().err


async def test_a_text_request_is_refused_naming_the_field():
    async with worker() as h:
        with pytest.raises(InvalidRequest, match="text mode"):
            await collect(h, GenerateRequest(request_id="r", model="m", token_ids=[5], text=TextInput(prompt="hi")))

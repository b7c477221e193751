"""What a frontend, mocker or router process imports before it serves: not the libraries only some requests or
flags need (nats-py with aiohttp: the NATS planes; jsonschema: a request's JSON schema; httpx: an image URL). They
were ~0.55 s of CPU of every frontend start and ~0.15 s of every mocker or router start, and the test suite starts
some 300 of them on 2 cores (docs/operations/tests.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LAZY = ("nats", "aiohttp", "jsonschema", "httpx")


@pytest.mark.parametrize("main", ["turbine.frontend.__main__", "turbine.mocker.__main__", "turbine.router.__main__"])
def test_a_process_start_leaves_out_what_only_some_requests_need(main):
    code = f"import sys, json, {main}; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {LAZY!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []

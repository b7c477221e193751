"""The load generator of the GPU serving benchmark (benchmarks/gpu/gpu_serving.py, issue #29 §5), against a local
stand-in that streams completions: every request of a point is sent, whatever the concurrency and the number of
client processes."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.gpu.gpu_serving import load_point


class _Streamer(BaseHTTPRequestHandler):
    """A streamed /v1/completions: `max_tokens` chunks, then usage, then [DONE]; counts what it was sent."""
    prompts: list[list[int]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).prompts.append(body["prompt"])
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Streamer.prompts = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Streamer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.mark.parametrize("concurrency,requests,processes", [(1, 2, 8), (3, 7, 8), (4, 8, 2)])
def test_every_request_of_a_point_is_sent_whatever_the_client_processes(server, concurrency, requests, processes):
    r = load_point(server, "m", isl=4, osl=3, concurrency=concurrency, requests=requests, processes=processes,
                   seed="s")
    assert (r["ok"], r["errors"]) == (requests, 0)
    assert len(_Streamer.prompts) == requests
    assert len({tuple(p) for p in _Streamer.prompts}) == requests  # each prompt once
    assert r["output_tok_s"] > 0 and r["client_processes"] == min(concurrency, processes)

"""Load generation over HTTP: streamed OpenAI requests timed from the client side."""

from __future__ import annotations

import json
import time


class StreamError(Exception):
    """An OpenAI streaming response that failed: an HTTP error, or an error chunk."""


async def sse_chunks(client, url: str, body: dict):
    """The JSON chunks of one OpenAI streaming response (httpx client), up to [DONE]."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise StreamError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()  # "data: x" or "data:x": both are SSE
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamError(str(chunk["error"])[:300])
            yield chunk


def record_usage(rec: dict, chunk: dict) -> None:
    """Copies a chunk's usage (prompt, completion and cached tokens) into a request record."""
    usage = chunk.get("usage")
    if usage:
        rec["prompt_tokens"] = usage.get("prompt_tokens")
        rec["completion_tokens"] = usage.get("completion_tokens")
        rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def read_stream(client, url: str, body: dict, rec: dict, on_chunk) -> None:
    """Reads one streaming response into a request record: `on_chunk(chunk, arrival time)` for every chunk, the
    usage, any failure (HTTP, an error chunk, an exception) as `error`, and `t_end`."""
    try:
        async for chunk in sse_chunks(client, url, body):
            on_chunk(chunk, time.monotonic())
            record_usage(rec, chunk)
    except StreamError as e:
        rec["error"] = str(e)
    except Exception as e:  # noqa: BLE001  (recorded, counted as an error)
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["t_end"] = time.monotonic()


async def stream_request(client, url: str, body: dict, kind: str) -> dict:
    """One streaming request; times from the send to the first non-empty content and the last."""
    rec = {"t_send": time.monotonic(), "t_first": None, "t_last": None, "prompt_tokens": None, "cached_tokens": None,
           "completion_tokens": None, "error": None, "text": ""}
    parts = []

    def on_chunk(chunk: dict, now: float) -> None:
        for choice in chunk.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") if kind == "chat" else choice.get("text")
            if text:
                if rec["t_first"] is None:
                    rec["t_first"] = now
                rec["t_last"] = now
                parts.append(text)

    await read_stream(client, url, body, rec, on_chunk)
    rec["text"] = "".join(parts)
    if rec["error"] is None and (rec["t_first"] is None or rec["completion_tokens"] is None):
        rec["error"] = "no content or no usage"
    return rec


async def drive(workload, url: str) -> tuple[list[dict], float]:
    import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        records: list[dict] = []
        t0 = time.monotonic() + 0.5
        await workload.run(client, url, records, t0)
    return records, t0

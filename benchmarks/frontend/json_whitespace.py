#!/usr/bin/env python3
r"""Forced tool calls and JSON outputs on a small model: JSON's free whitespace (vLLM's default) vs
compact JSON (the vLLM worker's --json-whitespace compact), on one real vLLM CPU engine each, run
one after the other with the same requests.

The test set: tools of several shapes (flat, nested objects, arrays, enums, numbers) forced by name
and by `required`, and `response_format` json_schema / json_object, each prompt asked greedily and
sampled (temperature 1.0, fixed seeds), through the frontend's /v1/chat/completions. Per answer:
whether it ended by itself (finish_reason stop / tool_calls) and its JSON parses and validates
against the schema, whether max_tokens cut it, its completion tokens, and the whitespace characters
in the JSON. Quality is not timed: no timings are compared.

  python -m benchmarks.frontend.json_whitespace [--max-tokens 96] [--seeds 3] [--concurrency 8]

Writes benchmarks/results/frontend/json_whitespace-DATE.json and prints a table (docs/benchmarks/frontend.md, "JSON whitespace").
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks.lib.paths import REPO_ROOT
from benchmarks.lib.proc import http_post_json, log
from benchmarks.lib.stack import Stack, start_turbine
from turbine.runtime.ports import free_port


SERVED = "json-whitespace-model"
SCHEMAS = {
    "weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"]},
    "event": {"type": "object", "properties": {
        "title": {"type": "string"}, "start": {"type": "object", "properties": {
            "date": {"type": "string"}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["date", "hour"]},
        "attendees": {"type": "array", "items": {"type": "string"}}}, "required": ["title", "start", "attendees"]},
    "search": {"type": "object", "properties": {
        "query": {"type": "string"}, "kind": {"type": "string", "enum": ["web", "news", "images"]},
        "limit": {"type": "integer"}, "safe": {"type": "boolean"}}, "required": ["query", "kind", "limit", "safe"]},
    "order": {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"]}}, "express": {"type": "boolean"}}, "required": ["items", "express"]},
}
PROMPTS = {
    "weather": ["What will the weather be in Paris for the next 3 days?", "Weather in Tokyo this week?"],
    "event": ["Book a meeting called Sync on 2026-12-01 at 10 with Ana and Bo.", "Plan lunch with Kim tomorrow at 12."],
    "search": ["Find news about the Mars rover, 5 results, safe search on.", "Search the web for pasta recipes."],
    "order": ["Order 2 of sku A1 at 3.50 and 1 of B2 at 10, express.", "I want three pencils, sku P9, 0.99 each."],
}


def requests(seeds: int, max_tokens: int):
    """(case name, schema, chat body) for every case of the test set."""
    for name, schema in SCHEMAS.items():
        tool = {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                                 "parameters": schema}}
        for prompt in PROMPTS[name]:
            for sampling in [{"temperature": 0}] + [{"temperature": 1.0, "seed": s} for s in range(seeds)]:
                base = {"model": SERVED, "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}],
                        **sampling}
                yield f"named:{name}", schema, dict(base, tools=[tool],
                                                    tool_choice={"type": "function", "function": {"name": name}})
                yield f"required:{name}", schema, dict(base, tools=[tool], tool_choice="required",
                                                       parallel_tool_calls=False)
                yield f"json_schema:{name}", schema, dict(base, response_format={
                    "type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
                yield f"json_object:{name}", None, dict(base, response_format={"type": "json_object"})


def judge(schema, body: dict, answer: dict) -> dict:
    import jsonschema

    choice = answer["choices"][0]
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    text = calls[0]["function"]["arguments"] if calls else (msg.get("content") or "")
    finish = choice["finish_reason"]
    ended = finish in ("stop", "tool_calls")
    valid = False
    if ended and (calls or "response_format" in body):
        try:
            value = json.loads(text)
            if schema is not None:
                jsonschema.validate(value, schema)
            valid = isinstance(value, dict)
        except (ValueError, jsonschema.ValidationError):
            valid = False
    return {"ended": ended, "valid": valid, "cut": finish == "length",
            "tokens": answer["usage"]["completion_tokens"],
            "whitespace": sum(ch in " \n\t\r" for ch in text)}


def run_mode(a, mode: str, run_dir: Path) -> list[dict]:
    st = Stack("turbine", run_dir, f"ws-{mode}")
    start_turbine(st, a.python, ["-m", "turbine.vllm", "--served-model-name", SERVED, "--system-port",
                                 str(free_port()), "--enforce-eager", "--max-model-len", "2048",
                                 "--json-whitespace", mode], worker_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    st.wait_ready(lambda: st.models_ready(SERVED, True), a.startup_timeout)
    from concurrent.futures import ThreadPoolExecutor

    def one(item) -> dict:
        case, schema, body = item
        status, answer = http_post_json(f"{st.base_url}/v1/chat/completions", body, timeout=600)
        if status != 200:
            raise RuntimeError(f"{mode} {case}: HTTP {status} {answer}")
        return {"mode": mode, "case": case, "temperature": body["temperature"], **judge(schema, body, answer)}

    try:
        with ThreadPoolExecutor(a.concurrency) as pool:  # the engine batches them
            return list(pool.map(one, requests(a.seeds, a.max_tokens)))
    finally:
        st.stop()


def summarize(recs: list[dict]) -> dict:
    n = len(recs)
    return {"answers": n, "ended_valid": sum(r["ended"] and r["valid"] for r in recs) / n,
            "ended_invalid": sum(r["ended"] and not r["valid"] for r in recs) / n,
            "cut_by_max_tokens": sum(r["cut"] for r in recs) / n,
            "mean_completion_tokens": sum(r["tokens"] for r in recs) / n,
            "mean_whitespace_chars": sum(r["whitespace"] for r in recs) / n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seeds", type=int, default=3, help="sampled answers per prompt (temperature 1.0)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--modes", default="any,compact")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "frontend"
                                        / f"json_whitespace-{_dt.date.today().isoformat()}.json"))
    a = p.parse_args(argv)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(f"/tmp/turbine-json-whitespace-{stamp}")
    run_dir.mkdir(parents=True, exist_ok=True)
    started, recs = time.time(), []
    for mode in a.modes.split(","):
        recs += run_mode(a, mode, run_dir)
        log(f"{mode}: {summarize([r for r in recs if r['mode'] == mode])}")
    summary = {}
    for mode in a.modes.split(","):
        mine = [r for r in recs if r["mode"] == mode]
        summary[mode] = {"all": summarize(mine),
                         **{kind: summarize([r for r in mine if r["case"].startswith(kind + ":")])
                            for kind in ("named", "required", "json_schema", "json_object")}}
    lines = ["| whitespace | cases | ended, valid JSON | ended, invalid | cut by max_tokens | tokens | whitespace chars |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for mode, by in summary.items():
        for kind, s in by.items():
            lines.append(f"| {mode} | {kind} ({s['answers']}) | {s['ended_valid']:.0%} | {s['ended_invalid']:.0%} | "
                         f"{s['cut_by_max_tokens']:.0%} | {s['mean_completion_tokens']:.1f} | "
                         f"{s['mean_whitespace_chars']:.1f} |")
    table = "\n".join(lines)
    print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "benchmark": "json_whitespace", "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1), "command": [sys.executable, *sys.argv],
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()}, "config": vars(a),
        "summary": summary, "answers": recs, "markdown": table}, indent=2) + "\n")
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

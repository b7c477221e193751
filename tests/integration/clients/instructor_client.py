"""instructor's own code against a Turbine frontend, run with the separate venv that `make setup`
builds for it (.instructor-venv: instructor needs jiter<0.15, which no openai from 3.4 on allows,
so it cannot share the project's venv). Usage: python instructor_client.py BASE_URL MODEL.
Prints one JSON object: each mode -> the structured answer it parsed, or its error."""

from __future__ import annotations

import json
import sys

import instructor
import openai
import pydantic


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    out = {"versions": {"instructor": instructor.__version__, "openai": openai.__version__}}
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        try:
            city = patched.chat.completions.create(
                model=model, response_model=City, max_retries=0, temperature=0, max_tokens=80,
                messages=[{"role": "user", "content": "Name a big city in Europe."}])
            out[mode.value] = {"city": city.model_dump()}
        except Exception as exc:  # reported to the test, which names it
            out[mode.value] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

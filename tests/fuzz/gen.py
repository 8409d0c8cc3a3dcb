"""Fast seeded generators of hostile and valid wire inputs, shared by the property tests and
the long run (``python -m tests.fuzz.longrun``).

Every generator takes a ``random.Random`` and is deterministic for a seed. Inputs come in
three kinds, so that a decoder that refused everything would fail the tests:

* ``valid``: a well-formed message with random but legal field values (it must decode and
  the session must accept it);
* ``hostile``: a valid-shaped message with fields replaced by values of the wrong type,
  lone surrogates, huge numbers, unknown fields, deep nesting, invalid UTF-8, then often a
  few byte edits;
* ``raw``: random bytes, sometimes framed as JSON.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

RAW_TOKENS = ["1e400", "-1e400", "NaN", "Infinity", "1" + "0" * 400, "-" + "9" * 400, "1e-400", "0.0e99999", "-0"]
"""JSON number tokens that json.dumps cannot write: placed as ``"\\u0000RAW<i>"`` then swapped in."""

HOSTILE_STRINGS = [
    "",
    "\ud800",
    "\udfff",
    "a\udc00b",
    "\ud83d\ude00",
    "\x00",
    "é",
    "\ufffd",
    "[" * 80,
    "{" * 80,
    "\\",
    '"',
    "\n",
    "<think>",
    "\u2028",
    "x" * 300,
    "type.googleapis.com/rill.v1.GenerateConfig",
]
HOSTILE_NUMBERS: list[Any] = [
    0,
    1,
    -1,
    2,
    7,
    2**31,
    2**31 - 1,
    2**53 + 1,
    2**63,
    2**63 - 1,
    -(2**63) - 1,
    2**64,
    10**30,
    -(10**30),
    0.5,
    -0.0,
    1e-320,
    1e308,
    -1e308,
    3.5e38,
    1e-7,
]


def raw(index: int) -> str:
    """A placeholder that ``dumps`` replaces with ``RAW_TOKENS[index]`` (an unwritable number)."""
    return f"\x00RAW{index}"


def hostile_leaf(rng: random.Random) -> Any:
    """One JSON leaf chosen to hurt: surrogates, NUL, huge or tiny numbers, wrong types."""
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice(HOSTILE_STRINGS)
    if kind == 1:
        return rng.choice(HOSTILE_NUMBERS)
    if kind == 2:
        return raw(rng.randrange(len(RAW_TOKENS)))
    if kind == 3:
        return rng.choice([None, True, False, [], {}])
    if kind == 4:
        return "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randrange(1, 6)))
    return rng.randint(-(2**70), 2**70)


def random_json(rng: random.Random, depth: int = 3) -> Any:
    """A random JSON value of at most ``depth`` levels, with hostile leaves."""
    if depth <= 0 or rng.random() < 0.4:
        return hostile_leaf(rng)
    if rng.random() < 0.5:
        return [random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {
        str(hostile_leaf(rng)) if rng.random() < 0.3 else rng.choice("abxyz"): random_json(rng, depth - 1)
        for _ in range(rng.randrange(4))
    }


def deep(rng: random.Random) -> str:
    """A placeholder that ``dumps`` replaces with a value inside many levels of arrays/objects:
    around and well past the 64-level limit (written as text: ``json.dumps`` would recurse)."""
    levels = rng.choice([63, 64, 65, 100, 999, 5000, rng.randrange(1, 200)])
    return f"\x00DEEP{levels}:{rng.choice('[{')}"


def _deep_text(levels: int, opener: str) -> str:
    if opener == "[":
        return "[" * levels + "1" + "]" * levels
    return '{"a":' * levels + '"x"' + "}" * levels


def mutate(rng: random.Random, obj: Any, depth: int = 0) -> Any:
    """A copy of ``obj`` with one hostile change somewhere inside it."""
    if isinstance(obj, dict) and obj and depth < 4 and rng.random() < 0.6:
        key = rng.choice(list(obj))
        out = dict(obj)
        op = rng.randrange(5)
        if op == 0:
            del out[key]
        elif op == 1:
            out[rng.choice(["zz", "\ud800", "type", "event", "id", ""])] = random_json(rng)
        else:
            out[key] = mutate(rng, obj[key], depth + 1)
        return out
    if isinstance(obj, list) and obj and depth < 4 and rng.random() < 0.6:
        out_list = list(obj)
        index = rng.randrange(len(out_list))
        out_list[index] = mutate(rng, out_list[index], depth + 1)
        if rng.random() < 0.2:
            out_list *= rng.randrange(2, 6)
        return out_list
    if rng.random() < 0.4:  # same JSON type, extreme value: reaches the session's own checks
        if isinstance(obj, bool):
            return not obj
        if isinstance(obj, int):
            return rng.choice([n for n in HOSTILE_NUMBERS if isinstance(n, int)] + [-5, 0, 10**6, 2**62])
        if isinstance(obj, float):
            return rng.choice([n for n in HOSTILE_NUMBERS if isinstance(n, float)] + [1000.0, -1000.0, 1e-300])
        if isinstance(obj, str):
            return rng.choice(HOSTILE_STRINGS + [obj * 1000, "user", "system", "assistant", "tool", "wizard"])
    op = rng.randrange(4)
    if op == 0:
        return deep(rng)
    if op == 1:
        return random_json(rng)
    return hostile_leaf(rng)


_DEEP = re.compile(r'"(?:\\u0000|\x00)DEEP(\d+):([\[{])"')


def dumps(rng: random.Random, obj: Any) -> bytes:
    """JSON bytes of ``obj``: escaped or raw UTF-8 (lone surrogates then become invalid UTF-8)."""
    ensure_ascii = rng.random() < 0.5
    text = json.dumps(obj, ensure_ascii=ensure_ascii)
    if "RAW" in text:
        for index, token in enumerate(RAW_TOKENS):
            text = text.replace(json.dumps(raw(index), ensure_ascii=ensure_ascii), token)
    while "DEEP" in text and (match := _DEEP.search(text)):
        text = text[: match.start()] + _deep_text(int(match.group(1)), match.group(2)) + text[match.end() :]
    return text.encode("utf-8", "surrogatepass")


def edit_bytes(rng: random.Random, data: bytes) -> bytes:
    """A few random byte edits: flips, cuts, inserts of JSON punctuation or junk."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(out) + 1)
        op = rng.randrange(4)
        if op == 0 and out:
            out[min(pos, len(out) - 1)] = rng.randrange(256)
        elif op == 1:
            del out[pos : pos + rng.randint(1, 8)]
        elif op == 2:
            out[pos:pos] = rng.choice(
                [
                    b'"',
                    b"{",
                    b"}",
                    b"[",
                    b"]",
                    b",",
                    b":",
                    b"\\",
                    b"\\u",
                    b"\\ud800",
                    b"\xff",
                    b"\xed\xa0\x80",
                    b"null",
                    b"1e999",
                    b"-",
                    b"\x00",
                ]
            )
        else:
            del out[pos:]
    return bytes(out)


Kind = str
"""``"valid"``, ``"hostile"`` or ``"raw"``."""


def wire_input(rng: random.Random, valid: Callable[[random.Random], Any]) -> tuple[Kind, bytes]:
    """One input for a JSON codec whose valid messages ``valid(rng)`` builds."""
    roll = rng.random()
    if roll < 0.25:
        return "valid", json.dumps(valid(rng), ensure_ascii=rng.random() < 0.5).encode()
    if roll < 0.9:
        data = dumps(rng, mutate(rng, valid(rng)))
        return "hostile", edit_bytes(rng, data) if rng.random() < 0.3 else data
    if roll < 0.95:
        return "raw", rng.randbytes(rng.randrange(64))
    return "raw", b"[" * rng.randrange(1, 5000) + b"{" * rng.randrange(100)


# -- valid messages of each protocol ------------------------------------------------------------


def text(rng: random.Random) -> str:
    """A short non-empty prompt (ASCII, accents, emoji)."""
    return rng.choice(["hi", "Once upon a time", "é à ü", "emoji \U0001f600", "a\nb", "x" * rng.randrange(1, 40)])


def sampling(rng: random.Random, names: dict[str, str]) -> dict[str, Any]:
    """Legal sampling fields, each present with probability 1/2, under the wire's own names."""
    values = {
        "max_tokens": rng.randint(1, 16),
        "temperature": rng.choice([0.0, 0.3, 1.0, 1.7]),
        "top_p": rng.choice([0.1, 0.9, 1.0]),
        "top_k": rng.choice([0, 1, 5, 40]),
        "seed": rng.randrange(2**31),
        "stop": rng.sample(["\n", ".", "END"], rng.randrange(3)),
    }
    return {wire: values[name] for name, wire in names.items() if name in values and rng.random() < 0.5}


def openai_completion(rng: random.Random) -> dict[str, Any]:
    prompt = rng.choice([text(rng), [text(rng), text(rng)], [1, 2, 3], [[4, 5], [6]]])
    body: dict[str, Any] = {"prompt": prompt, "model": rng.choice(["fake", ""]), "stream": rng.random() < 0.5}
    body |= sampling(rng, {n: n for n in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")})
    if rng.random() < 0.3:
        body["n"] = rng.randint(1, 3)
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
    return body


def openai_chat(rng: random.Random) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(rng)}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": text(rng)}]})
    body: dict[str, Any] = {"messages": messages, "stream": rng.random() < 0.5}
    body |= sampling(rng, {n: n for n in ("max_tokens", "temperature", "top_p", "seed", "stop")})
    if rng.random() < 0.3:
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    if rng.random() < 0.2:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    if rng.random() < 0.3:
        body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
    return body


def openai_responses(rng: random.Random) -> dict[str, Any]:
    """A valid ``/v1/responses`` body: a string or items (messages, a call and its output)."""
    if rng.random() < 0.5:
        given: Any = text(rng)
    else:
        given = [{"role": "user", "content": [{"type": "input_text", "text": text(rng)}]}]
        if rng.random() < 0.4:
            given += [
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": text(rng)},
            ]
    body: dict[str, Any] = {"input": given, "stream": rng.random() < 0.5}
    body |= sampling(rng, {"max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p"})
    if rng.random() < 0.3:
        body["instructions"] = text(rng)
    if rng.random() < 0.3:
        body["tools"] = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    if rng.random() < 0.2:
        body["text"] = {"format": {"type": "json_object"}}
    if rng.random() < 0.2:
        body["include"], body["top_logprobs"] = ["message.output_text.logprobs"], rng.randint(0, 5)
    return body


def generate_ws(rng: random.Random) -> dict[str, Any]:
    kind = rng.random()
    if kind < 0.7:
        config: dict[str, Any] = {"type": "config", "prompt": text(rng)}
        if rng.random() < 0.7:
            config["parameters"] = sampling(
                rng, {n: n for n in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")}
            )
        if rng.random() < 0.3:
            config["options"] = {"stream": rng.random() < 0.5, "include_token_ids": True, "include_timing": True}
        if rng.random() < 0.2:
            config["resumable"] = True
        return config
    if kind < 0.75:
        return {"type": "resume", "request_id": f"gen_{rng.randrange(4)}", "last_index": rng.randint(-1, 5)}
    if kind < 0.9:
        action = rng.choice(["stop", "pause", "resume", "regenerate", "modify"])
        control: dict[str, Any] = {"type": "control", "action": action}
        if action == "modify":
            control["parameters"] = {"temperature": rng.choice([0.0, 0.5])}
        return control
    return {"type": "feedback", "rating": rng.choice([-1, 0, 1, 0.5]), "text": text(rng)}


def generate_rest(rng: random.Random) -> dict[str, Any]:
    body = {"prompt": text(rng), "stream": rng.random() < 0.5}
    return body | sampling(rng, {n: n for n in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")})


def batch_ws(rng: random.Random) -> dict[str, Any]:
    prompts = [{"request_id": f"r{i}", "prompt": text(rng)} for i in range(rng.randint(1, 3))]
    body: dict[str, Any] = {"prompts": prompts}
    if rng.random() < 0.5:
        body["generation_config"] = sampling(
            rng, {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
        )
    if rng.random() < 0.5:
        body["stream_response"] = rng.random() < 0.5
        body["only_new_tokens"] = rng.random() < 0.5
    return body


def chat_ws(rng: random.Random) -> dict[str, Any]:
    content: Any = text(rng) if rng.random() < 0.6 else [{"type": "text", "text": text(rng)}]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "tts": {"enabled": False}}
    if rng.random() < 0.5:
        body["generation"] = sampling(
            rng, {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p"}
        )
    if rng.random() < 0.3:
        body["streaming"] = rng.random() < 0.5
    return body


def framed_uds(rng: random.Random) -> dict[str, Any]:
    kind = rng.random()
    if kind < 0.8:
        request: dict[str, Any] = {"id": f"q{rng.randrange(100)}", "prompt": text(rng)}
        request |= sampling(rng, {n: n for n in ("max_tokens", "temperature", "top_p", "top_k")})
        if rng.random() < 0.3:
            request["stream"] = rng.random() < 0.5
        if rng.random() < 0.2:
            request["slo"] = {"target_ttft_ms": rng.choice([1, 100, 70000])}
        if rng.random() < 0.2:
            request["metadata"] = {"user": text(rng)}
        return request
    if kind < 0.9:
        return {"event": "cancel", "id": f"q{rng.randrange(100)}"}
    return {"event": "metrics"}

"""Seeded random inputs: the decoders and the session raise only documented errors (STYLE rule 9)."""

from __future__ import annotations

import json
import random

from rill.errors import RillError
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.errors import InvalidMessage
from rill.protocols.evergreen.messages import GenerateConfig
from rill.protocols.evergreen.session import EvergreenSession, Generate, ModelFacts, SessionLimits

from .helpers import engine_output, eot, generate, leaf, msg, parent

IDS = [f"n{i}" for i in range(8)]


def random_item(rng: random.Random):
    kind = rng.random() * 0.9 if rng.random() < 0.5 else rng.random()
    node_id = rng.choice(IDS)
    # Mostly valid choices, so that runs get past the first rule and reach actions and outputs.
    seq = rng.choice([0] * 8 + [1, 2, -1])
    continued = rng.random() < 0.2
    if kind < 0.35:
        return parent(node_id, *rng.sample(IDS, rng.randint(1, 3)), seq=seq, continued=continued)
    if kind < 0.75:
        mimetype = rng.choice(
            ["text/plain", "text/markdown", None, "image/png", "application/x-protobuf; type=EndOfTurn"]
        )
        mimetype = mimetype if rng.random() < 0.3 else "text/plain"
        return leaf(
            node_id,
            rng.choice(["a", "", "é"]),
            seq=seq,
            continued=continued,
            mimetype=mimetype,
            role=rng.choice(["", "", "", "user", "model", "SYSTEM", "robot"]),
        )
    if kind < 0.8:
        return eot(node_id)
    output_id = rng.choice(IDS + [None]) if rng.random() < 0.2 else f"out{rng.randrange(10**6)}"
    return generate(
        rng.choice(IDS),
        output_id,
        input_name=rng.choice(["prompt"] * 5 + ["text", "x"]),
        name=rng.choice(["GENERATE"] * 8 + ["OTHER"]),
        config=GenerateConfig(max_tokens=3),
    )


def test_random_sessions_raise_only_rill_errors():
    num_started = 0
    for seed in range(300):
        rng = random.Random(seed)
        session = EvergreenSession(SessionLimits(max_depth=4, max_nodes=7, max_actions=3), ModelFacts(name="m"))
        try:
            for _ in range(rng.randint(1, 25)):
                for command in session.receive(msg(random_item(rng))):
                    if isinstance(command, Generate):
                        session.request_for(command, {})
                        num_started += 1
                        for text, finished in (("x", False), ("y", True)):
                            session.on_output(command.action_id, engine_output(text, finished), 0.0)
            session.on_input_end()
        except RillError:
            pass
    assert num_started > 0  # mostly valid items: a session refusing everything must fail here


def test_random_json_raises_only_invalid_message():
    valid = codec.encode_json(msg(parent("p", "a"), leaf("a", "x"), generate()))
    num_decoded = 0
    for seed in range(200):
        rng = random.Random(seed)
        text = list(valid)
        for _ in range(rng.randint(1, 5)):
            position = rng.randrange(len(text))
            text[position] = rng.choice(['"', "{", "}", "[", "]", ",", ":", "1", "a", "é", "\\", " "])
        try:
            codec.decode_json("".join(text))
            num_decoded += 1
        except InvalidMessage:
            pass
    assert 0 < num_decoded < 200  # some edits stay valid (inside a string, a digit): refusing all fails


def test_random_json_values_raise_only_invalid_message():
    values = [None, 1, -1, 2**40, 1.5, "x", "", [], {}, [1], {"a": 1}, True]
    num_decoded = 0
    for seed in range(100):
        rng = random.Random(seed)
        obj = {
            "nodeFragments": [
                {
                    "id": rng.choice(values),
                    "seq": rng.choice(values),
                    "continued": rng.choice(values),
                    "childIds": rng.choice(values),
                    "chunkFragment": rng.choice(values),
                }
            ],
            "actions": [
                {
                    "name": rng.choice(values),
                    "inputs": rng.choice(values),
                    "configs": rng.choice(values),
                    "targetSpec": rng.choice(values),
                }
            ],
        }
        try:
            codec.decode_json(json.dumps(obj))
            num_decoded += 1
        except InvalidMessage:
            pass
    assert num_decoded < 100  # most draws hold a mistyped field
    # ... and the same shape with well-typed values decodes: a decoder refusing all fails here.
    assert (
        codec.decode_json(
            json.dumps(
                {"nodeFragments": [{"id": "x", "seq": 1, "continued": True, "childIds": [], "chunkFragment": {}}]}
            )
        )
        .node_fragments[0]
        .id
        == "x"
    )


def test_random_protobuf_bytes_raise_only_invalid_message():
    payload_valid = codec.to_pb(msg(parent("p", "a"), leaf("a", "x"), generate())).SerializeToString()
    num_decoded = 0
    for seed in range(100):
        rng = random.Random(seed)
        payload = bytearray(payload_valid)
        for _ in range(rng.randint(1, 4)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        try:
            codec.decode_pb(bytes(payload))
            num_decoded += 1
        except InvalidMessage:
            pass
    assert 0 < num_decoded < 100  # a flipped byte inside a string still parses: refusing all fails

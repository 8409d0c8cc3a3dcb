"""Builders of Evergreen wire structs for the tests (short names, README-like shapes)."""

from __future__ import annotations

from rill.protocols.evergreen import codec
from rill.protocols.evergreen.messages import (
    Action,
    Chunk,
    ChunkMetadata,
    GenerateConfig,
    NamedParameter,
    NodeFragment,
    SessionMessage,
    TargetSpec,
)
from rill.types import RequestOutput

EOT = "application/x-protobuf; type=EndOfTurn"


def engine_output(text: str, finished: bool = False) -> RequestOutput:
    """An engine output of an action's request: ``text``, the last one if ``finished``."""
    return RequestOutput(request_id="r", text=text, finished=finished, finish_reason="stop" if finished else None)


def leaf(
    node_id: str,
    text: str | None = "",
    *,
    seq: int = 0,
    continued: bool = False,
    mimetype: str | None = "text/plain",
    role: str = "",
    ref: str | None = None,
) -> NodeFragment:
    """A leaf fragment; metadata only when ``mimetype`` is given (seq 0 needs it)."""
    metadata = ChunkMetadata(mimetype=mimetype, role=role) if mimetype is not None else None
    data = text.encode() if text is not None and ref is None else None
    return NodeFragment(
        id=node_id, seq=seq, continued=continued, chunk_fragment=Chunk(metadata=metadata, data=data, ref=ref)
    )


def eot(node_id: str) -> NodeFragment:
    """An EndOfTurn leaf."""
    return NodeFragment(id=node_id, chunk_fragment=Chunk(metadata=ChunkMetadata(mimetype=EOT)))


def parent(node_id: str, *children: str, seq: int = 0, continued: bool = False) -> NodeFragment:
    """A parent fragment."""
    return NodeFragment(id=node_id, seq=seq, continued=continued, child_ids=tuple(children))


def generate(
    input_id: str = "p",
    output_id: str | None = "r",
    *,
    input_name: str = "prompt",
    output_name: str = "response",
    name: str = "GENERATE",
    config: GenerateConfig | None = None,
    configs: tuple = (),
    target: str | None = None,
) -> Action:
    """A GENERATE action."""
    packed = tuple(configs) + ((codec.encode_config(config),) if config is not None else ())
    return Action(
        name=name,
        inputs=(NamedParameter(name=input_name, id=input_id),),
        outputs=(NamedParameter(name=output_name, id=output_id),) if output_id is not None else (),
        configs=packed,
        target_spec=TargetSpec(id=target) if target is not None else None,
    )


def msg(*items: NodeFragment | Action) -> SessionMessage:
    """A SessionMessage of fragments and actions, in the given order within each kind."""
    return SessionMessage(
        node_fragments=tuple(i for i in items if isinstance(i, NodeFragment)),
        actions=tuple(i for i in items if isinstance(i, Action)),
    )


def customized_generate(config: GenerateConfig) -> list[SessionMessage]:
    """README "Customized generate action", one message per block."""
    return [
        msg(generate("prompt_1", "response_1", input_name="text", output_name="text", config=config)),
        msg(parent("prompt_1", "prompt_1_text", "prompt_1_eot")),
        msg(leaf("prompt_1_text", "Write a heroic novel about a half-eaten jam doughnut.")),
        msg(eot("prompt_1_eot")),
    ]


def streamed_chains(config: GenerateConfig) -> list[SessionMessage]:
    """README "Streamed chains", one message per block."""
    return [
        msg(generate("prompt_1", "response_1", input_name="text", output_name="text", config=config)),
        msg(parent("prompt_1", "prompt_1_text", continued=True)),
        msg(leaf("prompt_1_text", "Write a heroic novel about a half-eaten jam doughnut.")),
        msg(parent("prompt_1", "prompt_1_eot", seq=1)),
        msg(eot("prompt_1_eot")),
    ]


def conversation_turn_1(config: GenerateConfig, tag: str = "") -> list[SessionMessage]:
    """README two-turn conversation, turn 1 (text/plain in place of the video refs); ``tag``
    makes the prompt unique (so no earlier test's cache can serve it)."""
    return [
        msg(
            Action(
                name="GENERATE",
                inputs=(NamedParameter(name="prompt", id="prompt_1"),),
                outputs=(NamedParameter(name="response", id="response_1"),),
                configs=(codec.encode_config(config),),
            )
        ),
        msg(parent("prompt_1", "question_1", "video_1")),
        msg(leaf("question_1", f"Write a summary of this video{tag}: ")),
        msg(leaf("video_1", "A red car overtakes a blue car ", continued=True)),
        msg(leaf("video_1", "on the last lap.", seq=1)),
    ]


def conversation_turn_2(config: GenerateConfig) -> list[SessionMessage]:
    """README two-turn conversation, turn 2 (reuses prompt_1 and response_1)."""
    return [
        msg(generate("prompt_2", "response_2", config=config)),
        msg(parent("prompt_2", "prompt_1", "response_1", "question_2")),
        msg(leaf("question_2", "Who's winning?")),
    ]

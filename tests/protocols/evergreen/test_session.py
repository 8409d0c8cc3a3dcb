"""The sans-I/O session: one test per node-store rule, the barrier, actions, prompts and outputs."""

from __future__ import annotations

import pytest

from rill.errors import GenerationError, InvalidRequest, RequestTimeout
from rill.protocols._shared.actions import Abort, Rejected
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.errors import (
    InputMissing,
    NeedsChatTemplate,
    RefDenied,
    RuleBroken,
    SessionLimit,
    UnknownTarget,
    UnsupportedInput,
)
from rill.protocols.evergreen.messages import AnyMessage, GenerateConfig
from rill.protocols.evergreen.session import (
    AbortSession,
    Close,
    EvergreenSession,
    FileRef,
    Generate,
    ModelFacts,
    Send,
    SessionLimits,
    TextLeaf,
    TurnEnd,
)
from rill.protocols.evergreen.store import fragment_bytes
from rill.types import RequestOutput

from .helpers import (
    conversation_turn_1,
    conversation_turn_2,
    customized_generate,
    engine_output,
    eot,
    generate,
    leaf,
    msg,
    parent,
    streamed_chains,
)


def new(**limits) -> EvergreenSession:
    return EvergreenSession(SessionLimits(**limits), ModelFacts(name="tiny"))


def feed(session: EvergreenSession, *messages) -> list:
    commands = []
    for m in messages:
        commands += session.receive(m)
    return commands


def generates(commands: list) -> list[Generate]:
    return [c for c in commands if isinstance(c, Generate)]


def texts(command: Generate) -> list:
    return [(i.role, b"".join(i.pieces).decode()) if isinstance(i, TextLeaf) else "EOT" for i in command.items]


def status(exc: BaseException) -> str:
    return codec.status_of(exc)[0]


# -- node store rules (issue point 3) ---------------------------------------------------------------


def test_fragments_of_a_node_are_joined_in_seq_order_and_continued_keeps_it_open():
    s = new()
    assert generates(feed(s, msg(generate("p")), msg(leaf("p", "b", seq=1, mimetype=None, continued=True)))) == []
    assert generates(feed(s, msg(leaf("p", "a", continued=True)))) == []  # seq 1 is not final
    [g] = generates(feed(s, msg(leaf("p", "c", seq=2, mimetype=None))))
    assert texts(g) == [("user", "abc")]


def test_duplicate_id_seq_is_ignored_first_copy_wins_without_error():
    s = new()
    feed(s, msg(leaf("p", "first", continued=True)), msg(leaf("p", "second", continued=True)))
    [g] = generates(
        feed(s, msg(leaf("p", "!", seq=1, mimetype=None)), msg(leaf("p", "again", seq=1)), msg(generate("p")))
    )
    assert texts(g) == [("user", "first!")]


def test_fragment_past_the_final_one_aborts():
    s = new()
    feed(s, msg(leaf("p", "done")))
    with pytest.raises(RuleBroken, match="after the final fragment") as info:
        feed(s, msg(leaf("p", "more", seq=1, mimetype=None)))
    assert status(info.value) == "INVALID_ARGUMENT"


def test_final_fragment_below_an_already_received_seq_aborts():
    s = new()
    feed(s, msg(leaf("p", "x", seq=3, mimetype=None, continued=True)))
    with pytest.raises(RuleBroken, match="marked final"):
        feed(s, msg(leaf("p", "y", seq=1, mimetype=None)))


def test_metadata_comes_from_seq_0_identical_repeats_are_tolerated():
    s = new()
    [g] = generates(
        feed(
            s,
            msg(generate("p")),
            msg(leaf("p", "a", continued=True, role="user")),
            msg(leaf("p", "b", seq=1, role="user")),
        )
    )
    assert texts(g) == [("user", "ab")]


@pytest.mark.parametrize("seq0_first", [True, False])
def test_conflicting_metadata_on_a_later_fragment_aborts(seq0_first):
    s = new()
    first = msg(leaf("p", "a", continued=True))
    later = msg(leaf("p", "b", seq=1, mimetype="text/markdown"))
    with pytest.raises(RuleBroken, match="metadata different from seq 0"):
        feed(s, *((first, later) if seq0_first else (later, first)))


def test_seq_0_of_a_leaf_without_metadata_aborts():
    with pytest.raises(RuleBroken, match="seq 0 of a leaf must carry"):
        feed(new(), msg(leaf("p", "a", mimetype=None)))


def test_leaf_and_parent_are_exclusive_within_a_fragment():
    from rill.protocols.evergreen.messages import Chunk, ChunkMetadata, NodeFragment

    both = NodeFragment(id="p", child_ids=("c",), chunk_fragment=Chunk(metadata=ChunkMetadata(mimetype="text/plain")))
    with pytest.raises(RuleBroken, match="leaf or a parent"):
        feed(new(), msg(both))


def test_leaf_and_parent_are_exclusive_across_fragments():
    s = new()
    feed(s, msg(parent("p", "c", continued=True)))
    with pytest.raises(RuleBroken, match="mixes child_ids and chunk_fragment"):
        feed(s, msg(leaf("p", "x", seq=1, mimetype=None)))


def test_children_referenced_before_they_arrive_wait_for_them():
    s = new()
    assert generates(feed(s, msg(generate("p")), msg(parent("p", "a", "b")), msg(leaf("b", "B")))) == []
    [g] = generates(feed(s, msg(leaf("a", "A"))))
    assert texts(g) == [("user", "A"), ("user", "B")]


def test_a_streamed_parent_appends_child_ids_in_seq_order():
    s = new()
    [g] = generates(feed(s, *streamed_chains(GenerateConfig())))
    assert texts(g) == [("user", "Write a heroic novel about a half-eaten jam doughnut."), "EOT"]


@pytest.mark.parametrize("edges", [[("a", "a")], [("a", "b"), ("b", "c"), ("c", "a")]])
def test_cycles_abort(edges):
    s = new()
    with pytest.raises(RuleBroken, match="cycle"):
        for p, c in edges:
            feed(s, msg(parent(p, c, continued=True, seq=0)))


def test_nesting_past_the_configured_depth_aborts_in_either_order():
    s = new(max_depth=3)
    feed(s, msg(parent("n0", "n1")), msg(parent("n1", "n2")), msg(parent("n2", "n3")))  # 3 links: allowed
    with pytest.raises(RuleBroken, match="nests 4 levels deep, more than 3"):
        feed(s, msg(parent("n3", "n4")))
    s = new(max_depth=3)
    feed(s, msg(parent("n3", "n4")), msg(parent("n2", "n3")), msg(parent("n1", "n2")))  # children first
    with pytest.raises(RuleBroken, match="more than 3"):
        feed(s, msg(parent("n0", "n1")))


def test_node_limit_counts_referenced_nodes():
    s = new(max_nodes=3)
    with pytest.raises(SessionLimit, match="3 nodes") as info:
        feed(s, msg(parent("p", "a", "b", "c")))
    assert status(info.value) == "RESOURCE_EXHAUSTED"


def test_byte_limit_counts_inline_data():
    first = leaf("a", "12345")
    s = new(max_bytes=fragment_bytes(first) + 5)
    feed(s, msg(first))
    with pytest.raises(SessionLimit, match="more than"):
        feed(s, msg(leaf("b", "123456")))  # costs one byte more than "a": 6 > the 5 left


def test_open_action_limit():
    s = new(max_actions=2)
    feed(s, msg(generate("p", "r1"), generate("p", "r2")))
    with pytest.raises(SessionLimit, match="2 actions are already open"):
        feed(s, msg(generate("p", "r3")))


# -- barrier --------------------------------------------------------------------------------------------


def test_action_first_inputs_later_starts_exactly_when_complete():
    s = new()
    commands = [feed(s, m) for m in customized_generate(GenerateConfig(max_tokens=5))]
    assert [len(generates(c)) for c in commands] == [0, 0, 0, 1]
    [g] = commands[-1]
    assert texts(g) == [("user", "Write a heroic novel about a half-eaten jam doughnut."), "EOT"]
    assert g.config.max_tokens == 5


def test_inputs_first_action_later_starts_at_once():
    s = new()
    (*nodes,) = customized_generate(GenerateConfig())[1:]
    assert generates(feed(s, *nodes)) == []
    assert len(generates(feed(s, customized_generate(GenerateConfig())[0]))) == 1


def test_children_before_parents():
    s = new()
    feed(s, msg(leaf("q", "Q")), msg(eot("e")), msg(generate("p")))
    [g] = generates(feed(s, msg(parent("p", "q", "e"))))
    assert texts(g) == [("user", "Q"), "EOT"]


def test_output_of_an_earlier_action_is_an_input_later():
    s = new()
    feed(s, *conversation_turn_1(GenerateConfig()))
    assert generates(feed(s, *conversation_turn_2(GenerateConfig()))) == []  # response_1 still running
    commands = s.on_output("0", engine_output("Senna "), 0.0) + s.on_output("0", engine_output("leads.", True), 0.0)
    [g] = generates(commands)
    request = s.request_for(g, {})
    assert [(m.role, m.content) for m in request.messages] == [
        ("user", "Write a summary of this video: A red car overtakes a blue car on the last lap."),
        ("assistant", "Senna leads."),
        ("user", "Who's winning?"),
    ]


# -- actions (issue point 4) ----------------------------------------------------------------------------


def test_unknown_action_name_is_invalid_argument():
    with pytest.raises(RuleBroken, match="unknown action name 'SUMMARIZE'") as info:
        feed(new(), msg(generate(name="SUMMARIZE")))
    assert status(info.value) == "INVALID_ARGUMENT"


def test_unknown_config_type_is_invalid_argument():
    with pytest.raises(RuleBroken, match="unknown config type 'type.googleapis.com/x.Other'") as info:
        feed(new(), msg(generate(configs=(AnyMessage(type_url="type.googleapis.com/x.Other"),))))
    assert status(info.value) == "INVALID_ARGUMENT"


def test_unknown_target_is_not_found_and_the_model_name_or_empty_is_accepted():
    with pytest.raises(UnknownTarget, match="'gpt-9' is not served here") as info:
        feed(new(), msg(generate(target="gpt-9")))
    assert status(info.value) == "NOT_FOUND"
    feed(new(), msg(generate(target="tiny")), msg(generate("p", "r2", target="")))


@pytest.mark.parametrize("bad", [dict(input_name="image"), dict(output_name="video")])
def test_unknown_parameter_names_abort(bad):
    with pytest.raises(RuleBroken, match="unknown (input|output) name"):
        feed(new(), msg(generate(**bad)))


def test_omitted_output_means_nothing_runs():
    s = new()
    assert generates(feed(s, msg(generate("p", None)), msg(leaf("p", "x")))) == []
    assert s.num_open_actions == 0


@pytest.mark.parametrize("case", ["client_node", "earlier_output", "own_input"])
def test_output_ids_must_be_new(case):
    s = new()
    if case == "client_node":
        feed(s, msg(leaf("r", "x")))
    elif case == "earlier_output":
        feed(s, msg(generate("p", "r")))
    with pytest.raises(RuleBroken, match="not new"):
        feed(s, msg(generate("r" if case == "own_input" else "p", "r")))


def test_client_may_not_write_an_output_node():
    s = new()
    feed(s, msg(generate("p", "r")))
    with pytest.raises(RuleBroken, match="only the server writes it"):
        feed(s, msg(leaf("r", "x")))


def test_configs_become_sampling():
    # --max-tokens-cap is applied at admission for every protocol (tests/test_policy_e2e.py).
    s = EvergreenSession(SessionLimits(), ModelFacts(name="tiny"))
    [g] = generates(
        feed(
            s,
            msg(leaf("p", "x")),
            msg(generate(config=GenerateConfig(temperature=0.0, max_tokens=50, seed=3, stop=("!",)))),
        )
    )
    request = s.request_for(g, {})
    assert (
        request.sampling.temperature,
        request.sampling.max_tokens,
        request.sampling.seed,
        request.sampling.stop,
    ) == (0.0, 50, 3, ["!"])
    assert request.protocol == "evergreen"


# -- prompts ----------------------------------------------------------------------------------------------


def test_roles_and_end_of_turn_make_chat_turns():
    s = new()
    feed(
        s,
        msg(leaf("sys", "Be brief.", role="SYSTEM")),
        msg(leaf("u1", "Hi")),
        msg(eot("e1")),
        msg(leaf("u2", "Again")),
        msg(leaf("m", "Yes", role="model")),
    )
    [g] = generates(feed(s, msg(parent("p", "sys", "u1", "e1", "u2", "m")), msg(generate("p"))))
    request = s.request_for(g, {})
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("user", "Again"),
        ("assistant", "Yes"),
    ]


def test_without_a_chat_template_a_plain_prompt_is_text_and_roles_abort():
    s = EvergreenSession(SessionLimits(), ModelFacts(name="base", has_chat_template=False))
    [g] = generates(feed(s, msg(leaf("p", "Once")), msg(generate("p"))))
    assert s.request_for(g, {}).prompt == "Once"
    [g] = generates(feed(s, msg(leaf("m", "x", role="model")), msg(parent("q", "p", "m")), msg(generate("q", "r2"))))
    with pytest.raises(NeedsChatTemplate) as info:
        s.request_for(g, {})
    assert status(info.value) == "FAILED_PRECONDITION"


def test_empty_prompt_and_bad_utf8_are_invalid():
    s = new()
    [g] = generates(feed(s, msg(eot("p")), msg(generate("p"))))
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        s.request_for(g, {})
    [g] = generates(feed(s, msg(leaf("q", None)), msg(generate("q", "r2"))))
    assert isinstance(g.items[0], TextLeaf)
    s2 = new()
    from rill.protocols.evergreen.messages import Chunk, ChunkMetadata, NodeFragment

    bad = NodeFragment(id="b", chunk_fragment=Chunk(metadata=ChunkMetadata(mimetype="text/plain"), data=b"\xff"))
    [g] = generates(feed(s2, msg(bad), msg(generate("b"))))
    with pytest.raises(InvalidRequest, match="not valid UTF-8"):
        s2.request_for(g, {})


# -- media and refs (issue point 5) ------------------------------------------------------------------------


@pytest.mark.parametrize("mimetype", ["video/mp4", "image/png", "audio/wav"])
def test_media_leaves_abort_naming_the_mimetype(mimetype):
    s = new()
    with pytest.raises(UnsupportedInput, match=f"mimetype '{mimetype}'") as info:
        feed(s, msg(leaf("p", "x", mimetype=mimetype)), msg(generate("p")))
    assert status(info.value) == "INVALID_ARGUMENT"


def test_other_mimetypes_abort():
    with pytest.raises(UnsupportedInput, match="application/octet-stream"):
        feed(new(), msg(leaf("p", "x", mimetype="application/octet-stream")), msg(generate("p")))


def test_refs_other_schemes_abort():
    with pytest.raises(UnsupportedInput, match="scheme 'https'") as info:
        feed(new(file_roots=("/data",)), msg(leaf("p", ref="https://x/y")), msg(generate("p")))
    assert status(info.value) == "INVALID_ARGUMENT"


def test_file_refs_are_disabled_without_roots():
    with pytest.raises(RefDenied, match="--evergreen-file-root") as info:
        feed(new(), msg(leaf("p", ref="file:///data/a.txt")), msg(generate("p")))
    assert status(info.value) == "PERMISSION_DENIED"


@pytest.mark.parametrize("uri", ["file:///etc/passwd", "file:///data/../etc/passwd", "file:///database/x"])
def test_file_refs_outside_the_roots_abort(uri):
    with pytest.raises(RefDenied, match="outside the allowed file roots"):
        feed(new(file_roots=("/data",)), msg(leaf("p", ref=uri)), msg(generate("p")))


def test_file_refs_inside_a_root_are_read_by_the_adapter():
    s = new(file_roots=("/data",))
    [g] = generates(
        feed(
            s,
            msg(leaf("p", ref="file:///data/a%20b.txt", continued=True)),
            msg(leaf("p", " tail", seq=1, mimetype=None)),
            msg(generate("p")),
        )
    )
    assert g.refs == [FileRef("file:///data/a%20b.txt", "/data/a b.txt")]
    assert s.request_for(g, {"/data/a b.txt": b"head"}).messages[0].content == "head tail"


# -- outputs and the end of input -------------------------------------------------------------------------


def test_output_fragments_seq_0_has_metadata_continued_until_the_last():
    s = new()
    feed(s, msg(leaf("p", "x")), msg(generate("p", "out")))
    sent = [
        c.message.node_fragments[0]
        for c in s.on_output("0", engine_output("a"), 0.0)
        + s.on_output("0", engine_output(""), 0.0)
        + s.on_output("0", engine_output("b"), 0.0)
        + s.on_output("0", engine_output("c", True), 0.0)
        if isinstance(c, Send)
    ]
    assert [(f.id, f.seq, f.continued, f.chunk_fragment.data) for f in sent] == [
        ("out", 0, True, b"a"),
        ("out", 1, True, b"b"),
        ("out", 2, False, b"c"),
    ]
    assert sent[0].chunk_fragment.metadata.mimetype == "text/plain"
    assert sent[0].chunk_fragment.metadata.role == "model"
    assert all(f.chunk_fragment.metadata is None for f in sent[1:])


def test_input_end_closes_after_running_actions_finish():
    s = new()
    feed(s, msg(leaf("p", "x")), msg(generate("p")))
    assert s.on_input_end() == []
    assert isinstance(s.on_output("0", engine_output("done", True), 0.0)[-1], Close)


def test_input_end_with_a_missing_input_is_failed_precondition():
    s = new()
    feed(s, msg(parent("p", "never")), msg(generate("p")))
    with pytest.raises(InputMissing, match="'never'") as info:
        s.on_input_end()
    assert status(info.value) == "FAILED_PRECONDITION"


def test_messages_after_input_end_abort():
    s = new()
    s.on_input_end()
    with pytest.raises(RuleBroken):
        s.receive(msg(leaf("p", "x")))


def test_turn_end_items_keep_their_place():
    s = new()
    [g] = generates(feed(s, msg(eot("e")), msg(leaf("a", "A")), msg(parent("p", "e", "a", "e")), msg(generate("p"))))
    assert [type(i) for i in g.items] == [TurnEnd, TextLeaf, TurnEnd]


def test_the_typescript_clients_flow_metadata_on_every_fragment_and_an_empty_close_fragment():
    # actionengine-ts run.ts: the action first, then one fragment per chunk (metadata on each,
    # continued: true), then {id, seq: n, continued: false} with no payload.
    from rill.protocols.evergreen.messages import NodeFragment

    s = new()
    assert (
        generates(
            feed(
                s,
                msg(generate("in", "out")),
                msg(leaf("in", "Hel", continued=True, role="user")),
                msg(leaf("in", "lo", seq=1, continued=True, role="user")),
            )
        )
        == []
    )
    [g] = generates(feed(s, msg(NodeFragment(id="in", seq=2, continued=False))))
    assert [(m.role, m.content) for m in s.request_for(g, {}).messages] == [("user", "Hello")]


def test_media_the_model_takes_is_still_refused_with_a_clear_reason():
    s = EvergreenSession(SessionLimits(), ModelFacts(name="vlm", modalities=("text", "image")))
    with pytest.raises(UnsupportedInput, match="'image/png': Evergreen GENERATE does not pass image input"):
        feed(s, msg(leaf("p", "x", mimetype="image/png")), msg(generate("p")))


# -- failures: every one aborts the whole session (spec "Error handling") -------------------------------


def two_running() -> EvergreenSession:
    s = new()
    assert len(generates(feed(s, msg(leaf("p", "x"), generate("p", "r1"), generate("p", "r2"))))) == 2
    return s


def test_a_failed_output_aborts_the_session_and_every_running_action():
    s = two_running()
    timeout = RequestTimeout("the request reached its time limit")
    failed = RequestOutput(request_id="r", finished=True, finish_reason="error", error=timeout)
    assert s.on_output("0", failed, 0.0) == [AbortSession(timeout), Abort("0"), Abort("1")]
    assert s.on_output("1", engine_output("late", True), 0.0) == []  # nothing more is said
    assert s.on_error(RuntimeError("another")) == []  # the first failure wins


def test_a_failed_output_without_its_error_is_a_generation_error():
    s = two_running()
    [abort, *_] = s.on_output("1", RequestOutput(request_id="r", finished=True, finish_reason="error"), 0.0)
    assert isinstance(abort.error, GenerationError) and status(abort.error) == "INTERNAL"


def test_a_start_that_failed_aborts_the_others_only():
    s = two_running()
    exc = InvalidRequest("refused")
    assert s.on_start_failed("1", exc, 0.0) == [AbortSession(exc), Abort("0")]


def test_a_refused_input_is_counted_under_its_code_then_aborts():
    s = two_running()
    exc = RuleBroken("bad")
    assert s.on_refused(exc) == [Rejected("session_rule_broken"), AbortSession(exc), Abort("0"), Abort("1")]
    assert s.on_refused(exc) == []
    assert new().on_refused(ValueError("a bug"))[0] == Rejected("internal_error")


def test_after_close_outputs_are_not_answered():
    s = new()
    feed(s, msg(leaf("p", "x")), msg(generate("p")))
    s.on_input_end()
    assert isinstance(s.on_output("0", engine_output("done", True), 0.0)[-1], Close)
    assert s.on_error(RuntimeError("late")) == []

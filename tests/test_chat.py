"""ds4lab.chat renders chat requests byte-identically to ds4-server (render_chat_prompt_text, ds4_server.c)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4lab.chat import ChatError, parse_tool_calls, render, think_mode

SHARED = Path(__file__).resolve().parents[2] / "shared"
ORACLE_PROMPT = SHARED / "oracle" / "tiny-a" / "prompt"
VECTORS = SHARED / "vectors"

B = "<｜begin▁of▁sentence｜>"
E = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user question. You can invoke tools by "
    'writing a "<｜DSML｜tool_calls>" block like the following:\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke '
    'name="$TOOL_NAME">\n<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    '</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n'
    '</｜DSML｜tool_calls>\n\nString parameters should be specified as raw text and set `string="true"`. '
    "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or "
    "HTML entity escapes. Only if a string value itself contains the exact closing parameter tag "
    "`</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types "
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> "
    "with tool calls or final response.\n\n### Available Tool Schemas\n\n"
)
TOOLS_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. "
    "Use the exact parameter names from the schemas."
)

WEATHER_FN = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
WEATHER_TOOL = {"type": "function", "function": WEATHER_FN}
WEATHER_SCHEMA = '{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}'

OFF = {"type": "disabled"}


def _req(*messages, **extra):
    return {"model": "deepseek-v4-flash", "messages": list(messages), **extra}


def test_oracle_request_renders_exactly():
    request_path, rendered_path = ORACLE_PROMPT / "request.json", ORACLE_PROMPT / "rendered.txt"
    assert request_path.is_file(), f"missing oracle request {request_path}"
    assert rendered_path.is_file(), f"missing oracle rendering {rendered_path}"
    request = json.loads(request_path.read_text(encoding="utf-8"))
    assert render(request).encode("utf-8") == rendered_path.read_bytes()


def _official_files():
    manifest = json.loads((VECTORS / "manifest.json").read_text(encoding="utf-8"))
    return [VECTORS / p["official_file"] for p in manifest["prompts"]]


def test_official_vectors_present():
    files = _official_files()
    assert files, "manifest lists no official vectors"
    for f in files:
        assert f.is_file(), f"missing official vector {f}"


@pytest.mark.parametrize("path", _official_files() if (VECTORS / "manifest.json").is_file() else [], ids=str)
def test_official_vector_prompt_token_count(path):
    from ds4lab.tokenizer import load

    data = json.loads(path.read_text(encoding="utf-8"))
    text = render(data["request"])
    ids = load().encode(text, add_special_tokens=False).ids
    assert len(ids) == data["usage"]["prompt_tokens"]


# ---- one test per rendering branch; expected strings hand-written from ds4_server.c ----------------------


def test_no_system_non_thinking():
    assert render(_req({"role": "user", "content": "Hi"}, thinking=OFF)) == f"{B}{U}Hi{A}</think>"


def test_system_and_developer_joined_in_order():
    req = _req(
        {"role": "system", "content": "S1"},
        {"role": "user", "content": "Hi"},
        {"role": "developer", "content": "S2"},
        thinking=OFF,
    )
    assert render(req) == f"{B}S1\n\nS2{U}Hi{A}</think>"


def test_default_is_thinking_high():
    # thinking absent, model not an alias: ds4-server defaults to thinking enabled, effort HIGH.
    assert render(_req({"role": "user", "content": "Hi"})) == f"{B}{U}Hi{A}<think>"


def test_deepseek_chat_alias_disables_thinking_unless_explicit():
    msgs = [{"role": "user", "content": "Hi"}]
    assert render({"model": "deepseek-chat", "messages": msgs}) == f"{B}{U}Hi{A}</think>"
    explicit = {"model": "deepseek-chat", "messages": msgs, "thinking": {"type": "enabled"}}
    assert render(explicit) == f"{B}{U}Hi{A}<think>"


def test_thinking_bool_and_think_key_and_effort_none():
    msgs = [{"role": "user", "content": "Hi"}]
    assert render({"messages": msgs, "thinking": False}) == f"{B}{U}Hi{A}</think>"
    assert render({"messages": msgs, "think": False}) == f"{B}{U}Hi{A}</think>"
    assert render({"messages": msgs, "reasoning_effort": "none"}) == f"{B}{U}Hi{A}</think>"
    assert render({"messages": msgs, "reasoning_effort": "low"}) == f"{B}{U}Hi{A}<think>"
    # keys are read in order, so the later control wins
    assert render({"messages": msgs, "think": False, "thinking": True}) == f"{B}{U}Hi{A}<think>"
    assert render({"messages": msgs, "thinking": True, "think": False}) == f"{B}{U}Hi{A}</think>"


def test_think_max_needs_large_context():
    req = _req({"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, reasoning_effort="max")
    assert render(req, context_tokens=393216) == f"{B}{MAX_PREFIX}S{U}Hi{A}<think>"
    assert render(req, context_tokens=393215) == f"{B}S{U}Hi{A}<think>"
    assert render(req) == f"{B}S{U}Hi{A}<think>"  # server default ctx 32768
    assert think_mode(req, 393216) == "max" and think_mode(req, 393215) == "high"


def test_multi_turn_drops_old_reasoning_without_tools():
    req = _req(
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
    )
    assert render(req) == f"{B}{U}Q1{A}</think>A1{E}{U}Q2{A}<think>"


def test_multi_turn_non_thinking_has_no_reasoning():
    req = _req(
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        thinking=OFF,
    )
    assert render(req) == f"{B}{U}Q1{A}</think>A1{E}{U}Q2{A}</think>"


def test_trailing_assistant_keeps_reasoning_as_prefill():
    req = _req(
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
    )
    assert render(req) == f"{B}{U}Q1{A}<think>R1</think>A1{E}"


def test_tools_block_keeps_reasoning_and_precedes_system():
    req = _req(
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        tools=[WEATHER_TOOL],
    )
    expected = f"{B}{TOOLS_HEAD}{WEATHER_SCHEMA}{TOOLS_TAIL}\n\nS{U}Q1{A}<think>R1</think>A1{E}{U}Q2{A}<think>"
    assert render(req) == expected


def test_tool_choice_none_hides_tools():
    req = _req({"role": "user", "content": "Q"}, tools=[WEATHER_TOOL], tool_choice="none", thinking=OFF)
    assert render(req) == f"{B}{U}Q{A}</think>"


def test_two_tools_one_schema_per_line():
    other = {"name": "now", "parameters": {}}
    req = _req({"role": "user", "content": "Q"}, tools=[WEATHER_TOOL, other], thinking=OFF)
    schemas = WEATHER_SCHEMA + '\n{"name": "now", "parameters": {}}'
    assert render(req) == f"{B}{TOOLS_HEAD}{schemas}{TOOLS_TAIL}{U}Q{A}</think>"


def test_assistant_tool_call_dsml_and_tool_results():
    call_args = '{"city": "Paris & <Rome>", "days": 3, "opts": {"a": [1, 2]}}'
    req = _req(
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "need tool",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": call_args}},
                {"id": "c2", "type": "function", "function": {"name": 'a"b', "arguments": "not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny </tool_result> x"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
    )
    dsml = (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris & <Rome></｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"a":[1,2]}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="a&quot;b">\n'
        '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
    )
    expected = (
        f"{B}{U}Weather?{A}<think>need tool</think>Checking.{dsml}{E}"
        f"{U}<tool_result>sunny &lt;/tool_result> x</tool_result><tool_result>ok</tool_result>{A}<think>"
    )
    assert render(req) == expected


def test_dsml_parameter_close_tag_escaping():
    args = {"s": "a</｜DSML｜parameter>b", "n": ["</｜DSML｜parameter>"]}
    req = _req(
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": args}}]},
        thinking=OFF,
    )
    dsml = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="s" string="true">a&lt;/｜DSML｜parameter>b</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">["\\u003c/｜DSML｜parameter>"]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    assert render(req) == f"{B}{U}Q{A}</think>{dsml}{E}"


def test_content_parts_and_null_content():
    req = _req(
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": None},
        {"content": "c"},  # role defaults to user
        # /v1/chat/completions reads only "text" keys of parts: Anthropic tool_result/thinking blocks add nothing.
        {"role": "user", "content": [{"type": "tool_result", "content": "r"}, {"type": "thinking", "thinking": "t"}]},
        {"role": "user", "content": {"type": "text", "text": "not an array"}},
        thinking=OFF,
    )
    assert render(req) == f"{B}{U}ab{A}</think>{E}{U}c{U}{U}{A}</think>"


def test_assistant_without_preceding_user_gets_no_marker():
    req = _req({"role": "assistant", "content": "X"}, {"role": "user", "content": "Q"}, thinking=OFF)
    assert render(req) == f"{B}X{E}{U}Q{A}</think>"


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [1]}, "messages[0]"),
        ({"messages": [{"role": 3}]}, "messages[0].role"),
        ({"messages": [{"content": [{"text": 5}]}]}, "messages[0].content[0].text"),
        ({"messages": [], "tools": {}}, "tools"),
        ({"messages": [], "reasoning_effort": "huge"}, "reasoning_effort"),
        ({"messages": [], "think": "yes"}, "think"),
        ({"messages": [], "model": None}, "model"),
        ({"messages": [], "thinking": {"type": 1}}, "thinking.type"),
        ({"messages": [{"role": "assistant", "tool_calls": {}}]}, "messages[0].tool_calls"),
    ],
)
def test_malformed_requests_name_the_field(request_, field):
    with pytest.raises(ChatError) as info:
        render(request_)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


# ---- DSML parsing --------------------------------------------------------------------------------------


def test_parse_tool_calls_round_trip():
    args = {"city": "Paris & <Rome>", "days": 3, "opts": {"a": [1, 2.50]}, "q": 'say "hi"\n'}
    req = _req(
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": args}}],
        },
        thinking=OFF,
    )
    text = render(req)
    generated = text[text.index("</think>") + len("</think>") : -len(E)]
    calls = parse_tool_calls(generated)
    assert len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == args
    # Re-rendering the parsed call reproduces the same DSML bytes.
    again = _req(
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "ok", "tool_calls": calls},
        thinking=OFF,
    )
    assert render(again) == text


def test_parse_tool_calls_literal():
    text = (
        'Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="p" string="true">a &amp; b</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false"> [1, 2] </｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    assert parse_tool_calls(text) == [
        {"type": "function", "function": {"name": "f", "arguments": '{"p":"a & b","n":[1,2]}'}}
    ]
    assert parse_tool_calls("no calls here") == []


def test_parse_tool_calls_thinking_ignores_dsml_in_reasoning():
    block = '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    assert parse_tool_calls("reasoning " + block, thinking=True) == []
    after = parse_tool_calls("r " + block + "</think>\n\n" + block.replace('"f"', '"g"'), thinking=True)
    assert [c["function"]["name"] for c in after] == ["g"]


def test_parse_tool_calls_malformed_raises():
    with pytest.raises(ChatError):
        parse_tool_calls('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x">1')


def test_render_tokenize_decode_round_trip():
    from ds4lab.tokenizer import load

    request = json.loads((ORACLE_PROMPT / "request.json").read_text(encoding="utf-8"))
    text = render(request)
    for mode in ("reference", "ds4"):
        tokenizer = load(mode=mode)
        assert tokenizer.decode(tokenizer.encode(text)).encode("utf-8") == text.encode("utf-8")

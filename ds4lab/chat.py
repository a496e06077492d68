"""Render OpenAI-style chat requests exactly as ds4-server does, and parse its DSML tool calls back.

This is a Python re-implementation of the prompt path of ds4-server's ``/v1/chat/completions``
endpoint (``parse_chat_request`` -> ``render_chat_prompt_text`` in ``ds4_server.c``). The output of
:func:`render` is the text ds4-server hands to its tokenizer, byte for byte.

Python receives an already-decoded ``dict``, whereas ds4-server reads the raw request bytes. Two
places in ds4 copy raw JSON text into the prompt; here that text is re-serialized instead:

* each tool's ``function`` object (OpenAI tools) or the whole tool object (other tools) is written with
  ``json.dumps(..., ensure_ascii=False)`` (``", "`` / ``": "`` separators, the layout of Python clients
  that post ``json.dumps`` output); a client that sends other spacing gets other bytes from ds4;
* tool-call ``arguments`` given as an object rather than a string are re-serialized the same way
  before ds4's argument parser sees them (only key order and string/non-string typing survive that
  parser, so this is exact unless the object contains non-ASCII text that the client escaped).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "BOS",
    "DEFAULT_CONTEXT_TOKENS",
    "EOS",
    "THINK_MAX_MIN_CONTEXT",
    "THINK_MAX_PREFIX",
    "ChatError",
    "parse_tool_calls",
    "render",
    "think_mode",
]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

DSML = "｜DSML｜"
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

# ds4.c: the Think Max system preamble and the smallest context that keeps Think Max.
THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
THINK_MAX_MIN_CONTEXT = 393216
# ds4-server's default --ctx.
DEFAULT_CONTEXT_TOKENS = 32768

NONE, HIGH, MAX = "none", "high", "max"

TOOLS_INTRO = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. "
    'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as raw text and set `string="true"`. '
    "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with "
    "XML or HTML entity escapes. "
    "Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that "
    "tag as `&lt;/｜DSML｜parameter>` inside the value. "
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_OUTRO = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. "
    "Use the exact parameter names from the schemas."
)

_EFFORTS = {"max": MAX, "xhigh": HIGH, "high": HIGH, "medium": HIGH, "low": HIGH, "minimal": HIGH, "none": NONE}


class ChatError(ValueError):
    """A request ds4-server would reject as malformed; ``field`` names the offending JSON path."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# ----------------------------------------------------------------------------------------------------------
# JSON helpers mirroring ds4-server's lenient reader


def _raw(value: Any) -> str:
    """Stand-in for the raw JSON bytes a client would have sent for ``value``."""
    return json.dumps(value, ensure_ascii=False)


def _minify(raw: str) -> str:
    """Drop whitespace outside JSON strings (ds4's json_minify_raw_value)."""
    out = []
    in_string = escape = False
    for ch in raw:
        if in_string:
            out.append(ch)
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif not ch.isspace():
            out.append(ch)
    return "".join(out)


def _minify_value(raw: str) -> str:
    """json_minify_raw_value: minify the first JSON value in ``raw``; return ``raw`` unchanged if it is not JSON."""
    stripped = raw.lstrip(" \t\n\r\f\v")
    try:
        _, end = _DECODER.raw_decode(stripped)
    except ValueError:
        return raw
    return _minify(stripped[:end])


_DECODER = json.JSONDecoder(strict=False)
_WS = " \t\n\r\f\v"


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _args_parse(text: str) -> list[tuple[str, str, bool]] | None:
    """ds4's json_args_parse: top-level (key, value, is_string) of a JSON object, or None if not an object.

    String values are decoded; other values keep their raw text, minified.
    """
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return None
    i = _skip_ws(text, i + 1)
    out: list[tuple[str, str, bool]] = []
    try:
        while i < len(text) and text[i] != "}":
            if text[i] != '"':
                return None
            key, i = _DECODER.raw_decode(text, i)
            i = _skip_ws(text, i)
            if i >= len(text) or text[i] != ":":
                return None
            i = _skip_ws(text, i + 1)
            start = i
            value, i = _DECODER.raw_decode(text, i)
            if isinstance(value, str):
                out.append((key, value, True))
            else:
                out.append((key, _minify(text[start:i]), False))
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i += 1
            i = _skip_ws(text, i)
    except ValueError:
        return None
    if i >= len(text) or text[i] != "}":
        return None
    return out


def _json_escape(s: str) -> str:
    """ds4's json_escape: quote, escape only `"`, `\\`, and control characters."""
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _content(value: Any, field: str) -> str:
    """ds4's json_content: a string, null, or an array of strings / parts whose ``text`` strings are joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        return ""  # null and any other non-array value render as empty text
    parts = []
    for j, part in enumerate(value):
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and "text" in part:
            if not isinstance(part["text"], str):
                raise ChatError(f"{field}[{j}].text", "must be a string")
            parts.append(part["text"])
    return "".join(parts)


# ----------------------------------------------------------------------------------------------------------
# request parsing (parse_chat_request / parse_messages / parse_tools_value)


def think_mode(request: dict, context_tokens: int | None = None) -> str:
    """The think mode ds4-server picks for ``request``: ``"none"``, ``"high"`` or ``"max"``."""
    enabled = True
    effort = HIGH
    got_thinking = False
    model = "deepseek-v4-flash"
    for key, value in request.items():  # ds4 reads keys in order: a later "think"/"thinking" wins
        if key == "thinking":
            got_thinking = True
            if isinstance(value, bool):
                enabled = value
            elif isinstance(value, dict) and "type" in value:
                if not isinstance(value["type"], str):
                    raise ChatError("thinking.type", "must be a string")
                if value["type"] == "enabled":
                    enabled = True
                elif value["type"] == "disabled":
                    enabled = False
        elif key == "think":
            if not isinstance(value, bool):
                raise ChatError("think", "must be a boolean")
            enabled = value
            got_thinking = True
        elif key == "reasoning_effort" and value is not None:
            if not isinstance(value, str) or value not in _EFFORTS:
                raise ChatError("reasoning_effort", f"must be one of {sorted(_EFFORTS)} or null, got {value!r}")
            effort = _EFFORTS[value]
        elif key == "model":
            if not isinstance(value, str):
                raise ChatError("model", "must be a string")
            model = value
    if not got_thinking and model == "deepseek-chat":
        enabled = False
    if not got_thinking and model == "deepseek-reasoner":
        enabled = True
    mode = NONE if (not enabled or effort == NONE) else effort
    ctx = DEFAULT_CONTEXT_TOKENS if context_tokens is None else context_tokens
    if mode == MAX and max(ctx, 0) < THINK_MAX_MIN_CONTEXT:
        mode = HIGH
    return mode


def _tool_schemas(tools: Any) -> str:
    if tools is None:
        return ""
    if not isinstance(tools, list):
        raise ChatError("tools", "must be an array or null")
    lines = []
    for j, tool in enumerate(tools):
        if isinstance(tool, dict) and "function" in tool:
            raw = _raw(tool["function"])
        else:
            if isinstance(tool, dict) and tool.get("type") in ("namespace", "tool_search"):
                raise ChatError(f"tools[{j}].type", f"{tool['type']!r} tools are not supported by ds4lab.chat")
            raw = _raw(tool)
        if raw:
            lines.append(raw)
    return "\n".join(lines)


def _tool_calls(value: Any, field: str) -> list[tuple[str, str]]:
    """(name, arguments text) for each complete call; ds4 drops calls missing either."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ChatError(field, "must be an array or null")
    calls = []
    for j, call in enumerate(value):
        if not isinstance(call, dict):
            raise ChatError(f"{field}[{j}]", "must be an object")
        if "id" in call and not isinstance(call["id"], str):
            raise ChatError(f"{field}[{j}].id", "must be a string")
        name = arguments = None
        if "function" in call:
            fn = call["function"]
            if not isinstance(fn, dict):
                raise ChatError(f"{field}[{j}].function", "must be an object")
            if "name" in fn:
                if not isinstance(fn["name"], str):
                    raise ChatError(f"{field}[{j}].function.name", "must be a string")
                name = fn["name"]
            if "arguments" in fn:
                arguments = fn["arguments"] if isinstance(fn["arguments"], str) else _raw(fn["arguments"])
        if name is not None and arguments is not None:
            calls.append((name, arguments))
    return calls


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise ChatError("messages", "must be an array")
    msgs = []
    for i, m in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(field, "must be an object")
        role = m.get("role", "user")
        if not isinstance(role, str):
            raise ChatError(f"{field}.role", "must be a string")
        if "tool_call_id" in m and not isinstance(m["tool_call_id"], str):
            raise ChatError(f"{field}.tool_call_id", "must be a string")
        msgs.append(
            {
                "role": role,
                "content": _content(m.get("content"), f"{field}.content"),
                "reasoning": _content(m.get("reasoning_content"), f"{field}.reasoning_content"),
                "calls": _tool_calls(m.get("tool_calls"), f"{field}.tool_calls"),
            }
        )
    return msgs


# ----------------------------------------------------------------------------------------------------------
# rendering (render_chat_prompt_text and its helpers)


def _attr_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _dsml_string(s: str) -> str:
    return s.replace(PARAM_CLOSE, "&lt;" + PARAM_CLOSE[1:])


def _dsml_literal(s: str) -> str:
    return s.replace(PARAM_CLOSE, "\\u003c" + PARAM_CLOSE[1:])


def _tool_result(s: str) -> str:
    return s.replace(TOOL_RESULT_CLOSE, "&lt;" + TOOL_RESULT_CLOSE[1:])


def _dsml_param(key: str, value: str, is_string: bool) -> str:
    body = _dsml_string(value) if is_string else _dsml_literal(value)
    flag = "true" if is_string else "false"
    return f'{PARAM_OPEN} name="{_attr_escape(key)}" string="{flag}">{body}{PARAM_CLOSE}\n'


def _dsml_tool_calls(calls: list[tuple[str, str]]) -> str:
    if not calls:
        return ""
    out = ["\n\n" + TOOL_CALLS_OPEN + "\n"]
    for name, arguments in calls:
        out.append(f'{INVOKE_OPEN} name="{_attr_escape(name)}">\n')
        args = _args_parse(arguments)
        if args is None:
            out.append(_dsml_param("arguments", arguments, True))
        else:
            out.extend(_dsml_param(k, v, s) for k, v, s in args)
        out.append(INVOKE_CLOSE + "\n")
    out.append(TOOL_CALLS_CLOSE)
    return "".join(out)


def render(request: dict, context_tokens: int | None = None) -> str:
    """The prompt text ds4-server's ``/v1/chat/completions`` renders for ``request``.

    ``context_tokens`` is the server's ``--ctx`` (default 32768); Think Max needs at least 393216.
    """
    if not isinstance(request, dict):
        raise ChatError("request", "must be a JSON object")
    if "messages" not in request:
        raise ChatError("messages", "missing messages")
    msgs = _messages(request["messages"])
    schemas = _tool_schemas(request.get("tools"))
    choice = request.get("tool_choice")
    if isinstance(choice, str) and choice == "none":
        schemas = ""
    mode = think_mode(request, context_tokens)
    think = mode in (HIGH, MAX)

    tool_context = bool(schemas) or any(
        (m["role"] == "assistant" and m["calls"]) or m["role"] in ("tool", "function") for m in msgs
    )
    last_user = max((i for i, m in enumerate(msgs) if m["role"] in ("user", "tool", "function")), default=-1)

    system = TOOLS_INTRO + schemas + TOOLS_OUTRO if schemas else ""
    for m in msgs:
        if m["role"] in ("system", "developer"):
            system = system + "\n\n" + m["content"] if system else m["content"]

    out = [BOS, THINK_MAX_PREFIX if mode == MAX else "", system]
    pending_assistant = pending_tool = False
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "user":
            out += [USER, m["content"]]
            pending_assistant, pending_tool = True, False
        elif role in ("tool", "function"):
            if not pending_tool:
                out.append(USER)
            out += [TOOL_RESULT_OPEN, _tool_result(m["content"]), TOOL_RESULT_CLOSE]
            pending_assistant = pending_tool = True
        elif role == "assistant":
            if pending_assistant:
                out.append(ASSISTANT)
                if think and (tool_context or i > last_user):
                    out += [THINK_OPEN, m["reasoning"], THINK_CLOSE]
                else:
                    out.append(THINK_CLOSE)
            out += [m["content"], _dsml_tool_calls(m["calls"]), EOS]
            pending_assistant = pending_tool = False
    if pending_assistant:
        out += [ASSISTANT, THINK_OPEN if think else THINK_CLOSE]
    return "".join(out)


# ----------------------------------------------------------------------------------------------------------
# parsing generated text (parse_generated_message_ex)


def _unescape(s: str) -> str:
    out = []
    i = 0
    entities = (("&amp;", "&"), ("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&apos;", "'"))
    while i < len(s):
        if s[i] == "&":
            for ent, ch in entities:
                if s.startswith(ent, i):
                    out.append(ch)
                    i += len(ent)
                    break
            else:
                out.append("&")
                i += 1
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _attr(tag: str, name: str) -> str | None:
    pat = f'{name}="'
    p = tag.find(pat)
    if p < 0:
        return None
    p += len(pat)
    q = tag.find('"', p)
    if q < 0:
        return None
    return _unescape(tag[p:q])


def _arg_pair(name: str, value: str, is_string: str) -> str:
    if is_string == "true":
        return _json_escape(name) + ": " + _json_escape(value)
    mini = _minify_value(value)
    return _json_escape(name) + ": " + (mini or "null")


def _parse_leaf(text: str, i: int, p_open: str, p_close: str) -> tuple[str, int] | None:
    if not text.startswith(p_open, i):
        return None
    tag_end = text.find(">", i)
    if tag_end < 0:
        return None
    tag = text[i : tag_end + 1]
    name, is_string = _attr(tag, "name"), _attr(tag, "string")
    if name is None:
        return None
    value_end = text.find(p_close, tag_end + 1)
    if value_end < 0:
        return None
    raw = text[tag_end + 1 : value_end]
    kind = "true" if is_string is None else is_string
    value = _unescape(raw) if kind == "true" else raw
    return _arg_pair(name, value, kind), value_end + len(p_close)


def _api_arguments(internal: str) -> str:
    """ds4's append_json_object_or_empty: the compact JSON the API returns as ``arguments``."""
    args = _args_parse(internal)
    if args is None:
        return "{}"
    return "{" + ",".join(_json_escape(k) + ":" + (_json_escape(v) if s else v) for k, v, s in args) + "}"


def parse_tool_calls(text: str, thinking: bool = False) -> list[dict]:
    """DSML tool calls in generated assistant text, as the OpenAI-style dicts ds4-server returns.

    Each call is ``{"type": "function", "function": {"name": str, "arguments": str}}`` where ``arguments`` is
    the compact JSON object string ds4 emits (ids are random in ds4 and are left out). With ``thinking``
    (the request ran in a thinking mode) only text after the last ``</think>`` is searched, and text with
    no ``</think>`` has no calls, as in ds4. A malformed block raises :class:`ChatError` (ds4 then returns
    the raw text as content instead).
    """
    search_from = 0
    if thinking:
        close = text.rfind(THINK_CLOSE)
        if close < 0:
            return []
        search_from = close + len(THINK_CLOSE)

    short = "DSML｜"
    styles = [
        ("\n\n" + TOOL_CALLS_OPEN, 0),
        (TOOL_CALLS_OPEN, 0),
        (f"\n\n<{short}tool_calls>", 2),
        (f"<{short}tool_calls>", 2),
        ("\n\n<tool_calls>", 1),
        ("<tool_calls>", 1),
    ]
    start = -1
    style = 0
    for marker, st in styles:
        start = text.find(marker, search_from)
        if start >= 0:
            style = st
            break
    if start < 0:
        return []
    prefix = {0: f"{DSML}", 1: "", 2: short}[style]
    tc_open, tc_close = f"<{prefix}tool_calls>", f"</{prefix}tool_calls>"
    inv_open, inv_close = f"<{prefix}invoke", f"</{prefix}invoke>"
    p_open, p_close = f"<{prefix}parameter", f"</{prefix}parameter>"

    def bad(why: str) -> ChatError:
        return ChatError("text", f"malformed DSML tool call block: {why}")

    p = text.find(tc_open, start) + len(tc_open)
    calls: list[dict] = []
    while True:
        p = _skip_ws(text, p)
        if text.startswith(tc_close, p):
            return calls
        if not text.startswith(inv_open, p):
            raise bad(f"expected {inv_open!r} at offset {p}")
        tag_end = text.find(">", p)
        if tag_end < 0:
            raise bad("unterminated invoke tag")
        name = _attr(text[p : tag_end + 1], "name")
        if name is None:
            raise bad("invoke without name")
        p = tag_end + 1
        pairs: list[str] = []
        while True:
            p = _skip_ws(text, p)
            if text.startswith(inv_close, p):
                p += len(inv_close)
                break
            if not text.startswith(p_open, p):
                raise bad(f"expected {p_open!r} at offset {p}")
            tag_end = text.find(">", p)
            if tag_end < 0:
                raise bad("unterminated parameter tag")
            tag = text[p : tag_end + 1]
            pname, pstring = _attr(tag, "name"), _attr(tag, "string")
            if pname is None:
                raise bad("parameter without name")
            vstart = tag_end + 1
            if pstring is None and text.startswith(p_open, _skip_ws(text, vstart)):
                members: list[str] = []
                q = vstart
                while True:
                    q = _skip_ws(text, q)
                    if not text.startswith(p_open, q):
                        break
                    leaf = _parse_leaf(text, q, p_open, p_close)
                    if leaf is None:
                        raise bad("malformed nested parameter")
                    members.append(leaf[0])
                    q = leaf[1]
                pairs.append(_arg_pair(pname, "{" + ", ".join(members) + "}", "false"))
                p = _skip_ws(text, q)
                if text.startswith(p_close, p):
                    p += len(p_close)
                continue
            vend = text.find(p_close, vstart)
            if vend < 0:
                raise bad("unterminated parameter value")
            raw = text[vstart:vend]
            kind = "true" if pstring is None else pstring
            pairs.append(_arg_pair(pname, _unescape(raw) if kind == "true" else raw, kind))
            p = vend + len(p_close)
        internal = "{" + ", ".join(pairs) + "}"
        calls.append({"type": "function", "function": {"name": name, "arguments": _api_arguments(internal)}})

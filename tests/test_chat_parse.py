"""Parsing generated assistant text: reasoning split, content, every call in order, the parameter grammar,
schema conversion, and malformed output turned into `errors` (never an exception)."""
import random

import pytest

from mercury_jax.chat import parse_assistant, render_completion
from mercury_jax.chat.parse import convert_value

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "note": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
    "flag": {"type": "boolean"}, "nothing": {"type": "null"}, "tags": {"type": "array", "items": {"type": "string"}},
    "meta": {"type": "object"}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "either": {"type": ["string", "null"]}, "ref": {"$ref": "#/$defs/Point"}, "free": {},
}, "required": ["name"], "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
TOOLS = [{"type": "function", "function": {"name": "do", "parameters": SCHEMA}},
         {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                            "required": ["q"]}},
         {"name": "mcp_style", "inputSchema": {"type": "object", "properties": {"n": {"type": "integer"}}}}]


def call(tool, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={tool}>\n{body}</function>\n</tool_call>"


def test_reasoning_content_and_calls_when_the_prompt_opened_think():
    text = "plan the call\n</think>\n\nI will search.\n\n" + call("search", q="renewals") + "\n" + \
        call("do", name="x") + "<|im_end|>"
    turn = parse_assistant(text, TOOLS)
    assert (turn.reasoning, turn.content, turn.errors) == ("plan the call", "I will search.", [])
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("search", {"q": "renewals"}), ("do", {"name": "x"})]
    assert all(c.ok for c in turn.tool_calls)


def test_reasoning_with_an_explicit_think_tag():
    turn = parse_assistant("<think>\nhmm\n</think>\n\nAnswer.")
    assert (turn.reasoning, turn.content, turn.tool_calls, turn.errors) == ("hmm", "Answer.", [], [])


def test_no_think_close_means_all_reply():
    turn = parse_assistant("Just an answer.<|endoftext|>")
    assert (turn.reasoning, turn.content, turn.errors) == ("", "Just an answer.", [])


def test_unclosed_think_is_reasoning_and_an_error():
    turn = parse_assistant("<think>\nthinking forever " + call("search", q="x"), TOOLS)
    assert turn.reasoning.startswith("thinking forever") and turn.content == "" and turn.tool_calls == []
    assert any("never closed" in e for e in turn.errors)


def test_second_think_close_is_an_error():
    assert any("more than one" in e for e in parse_assistant("a</think>b</think>c").errors)


@pytest.mark.parametrize("value, expected", [
    ("count", ("7", 7)), ("count", ("-3", -3)), ("count", ("4.0", 4)),
    ("ratio", ("2.5", 2.5)), ("ratio", ("3", 3)), ("ratio", ("1e-3", 0.001)),
    ("flag", ("true", True)), ("flag", ("True", True)), ("flag", ("false", False)), ("flag", ("False", False)),
    ("nothing", ("null", None)), ("nothing", ("None", None)),
    ("count", ("1e3", 1000)), ("count", ("-0", 0)), ("count", (" 12 ", 12)), ("count", ("9" * 4300, int("9" * 4300))),
    ("ratio", ("-0.5e-2", -0.005)), ("ratio", ("1.5E+2", 150.0)),
    ("tags", ('["a", "b"]', ["a", "b"])), ("tags", ('[]', [])), ("tags", ('["\\u00fc", 1.5, -2]', ["ü", 1.5, -2])),
    ("meta", ('{"k": [1, null, true]}', {"k": [1, None, True]})), ("meta", ('{"\\ud83d\\ude00": 1}', {"😀": 1})),
    ("maybe", ("null", None)), ("maybe", ("None", None)), ("maybe", ("5", 5)),
    ("either", ("None", None)), ("either", ("text", "text")),
    ("ref", ('{"x": 1.5}', {"x": 1.5})), ("free", ("anything 1", "anything 1")),
    ("note", ("  spaced  \n", "  spaced  \n")), ("note", ("null", "null")), ("note", ("123", "123")),
])
def test_values_converted_by_schema(value, expected):
    text, result = expected
    turn = parse_assistant(f"<tool_call>\n<function=do>\n<parameter=name>\nn\n</parameter>\n"
                           f"<parameter={value}>\n{text}\n</parameter>\n</function>\n</tool_call>", TOOLS)
    assert turn.errors == []
    got = turn.tool_calls[0].arguments[value]
    assert got == result and type(got) is type(result)


def test_one_newline_stripped_each_side_and_multiline_kept():
    turn = parse_assistant("<tool_call>\n<function=search>\n<parameter=q>\n\nline 1\n\nline 2\n\n</parameter>\n"
                           "</function>\n</tool_call>", TOOLS)
    assert turn.tool_calls[0].arguments == {"q": "\nline 1\n\nline 2\n"}
    assert parse_assistant("<tool_call><function=search><parameter=q>x</parameter></function></tool_call>",
                           TOOLS).tool_calls[0].arguments == {"q": "x"}


def test_missing_parameter_close_is_tolerated():
    text = ("<tool_call>\n<function=do>\n<parameter=name>\nabc\n<parameter=count>\n3\n</function>\n</tool_call>")
    turn = parse_assistant(text, TOOLS)
    assert turn.errors == [] and turn.tool_calls[0].arguments == {"name": "abc", "count": 3}


def test_missing_tool_call_close_is_tolerated_when_the_function_closed():
    turn = parse_assistant("<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n", TOOLS)
    assert turn.errors == [] and turn.tool_calls[0].arguments == {"q": "x"}


def test_cut_off_call_is_an_error_and_not_ok():
    turn = parse_assistant("<tool_call>\n<function=search>\n<parameter=q>\nhalf a val", TOOLS)
    assert not turn.tool_calls[0].ok and "cut off" in turn.errors[0]


@pytest.mark.parametrize("text, needle", [
    (call("nope", q="x"), "unknown tool 'nope'"),
    (call("search", q="x", extra="y"), "unknown parameter 'extra'"),
    (call("do", count="3"), "missing required parameter: name"),
    (call("search"), "missing required parameter: q"),
    (call("do", name="a", count="three"), "parameter 'count': expects an integer"),
    (call("do", name="a", count="9" * 5000), "expects an integer"),  # beyond Python's int-string limit
    (call("do", name="a", ratio="nan"), "finite number"),
    (call("do", name="a", flag="yes"), "expects true or false"),
    (call("do", name="a", nothing="0"), "expects null"),
    (call("do", name="a", tags="{not json"), "expects an array"),
    (call("do", name="a", tags='{"a": 1}'), "expects an array"),
    (call("do", name="a", meta="[" * 100000), "expects an object"),  # deep nesting: no RecursionError
    ("<tool_call>\n<function=search>\n<parameter=q>\na\n</parameter>\n<parameter=q>\nb\n</parameter>\n"
     "</function>\n</tool_call>", "given more than once"),
    ("<tool_call>\njust words\n</tool_call>", "no <function=NAME>"),
    ("<tool_call>\n<function=search\n</tool_call>", "not closed with '>'"),
    ("<tool_call>\n<function=>\n</function>\n</tool_call>", "empty function name"),
    ("<tool_call>\nhello <function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>",
     "text before <function="),
    ("<tool_call>\n<function=search>\nstray\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>",
     "outside <parameter="),
    ("<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\ntail\n</tool_call>",
     "after </function>"),
])
def test_malformed_calls_are_call_errors(text, needle):
    turn = parse_assistant(text, TOOLS)
    assert len(turn.tool_calls) == 1 and not turn.tool_calls[0].ok
    assert any(needle in e for e in turn.tool_calls[0].errors), turn.tool_calls[0].errors
    assert any(needle in e for e in turn.errors)
    assert turn.tool_calls[0].error_message().startswith("Error: tool call")


@pytest.mark.parametrize("text, needle", [
    (call("search", q="x") + "\nand then some", "after the last </tool_call>"),
    (call("search", q="x") + " chatter " + call("search", q="y"), "between tool calls"),
    ("<function=search>\n<parameter=q>\nx\n</parameter>\n</function>", "outside a <tool_call>"),
    ("junk <think> junk </think> ok", "text before <think>"),
])
def test_turn_level_errors_keep_the_calls(text, needle):
    turn = parse_assistant(text, TOOLS)
    assert any(needle in e for e in turn.errors)
    assert all(c.ok for c in turn.tool_calls)


def test_without_tools_values_stay_strings_and_any_name_is_accepted():
    turn = parse_assistant(call("anything", n="5", flag="True"))
    assert turn.errors == [] and turn.tool_calls[0].arguments == {"n": "5", "flag": "True"}


def test_mcp_input_schema_is_understood():
    assert parse_assistant(call("mcp_style", n="4"), TOOLS).tool_calls[0].arguments == {"n": 4}


def test_huge_string_value_is_kept_whole():
    big = "x" * 1_000_000
    assert parse_assistant(call("search", q=big), TOOLS).tool_calls[0].arguments["q"] == big


def test_round_trip_through_render_completion():
    arguments = {"name": "multi\nline\n", "count": -12, "ratio": 0.25, "flag": False, "nothing": None,
                 "tags": ["a", "ü", ""], "meta": {"k": {"n": [1, None]}}, "maybe": None, "either": "e"}
    for thinking, reasoning in ((True, "think first"), (False, "")):
        message = {"role": "assistant", "content": "Calling.", "reasoning_content": reasoning,
                   "tool_calls": [{"name": "do", "arguments": arguments}, {"name": "search", "arguments": {"q": "z"}}]}
        turn = parse_assistant(render_completion(message, enable_thinking=thinking), TOOLS)
        assert turn.errors == [] and (turn.reasoning, turn.content) == (reasoning, "Calling.")
        assert [c.arguments for c in turn.tool_calls] == [arguments, {"q": "z"}]


def test_convert_value_direct():
    assert convert_value("3", {"type": "integer"}) == 3
    with pytest.raises(ValueError):
        convert_value("x", {"type": "number"})


def test_garbage_and_truncations_never_raise():
    rng = random.Random(0)
    valid = render_completion({"role": "assistant", "content": "c", "reasoning_content": "r", "tool_calls": [
        {"name": "do", "arguments": {"name": "a", "count": 3, "tags": ["x"]}}, {"name": "search",
                                                                                 "arguments": {"q": "b"}}]})
    pieces = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">",
              "\n", "<think>", "</think>", "do", "search", "q", "{", "[", "None", "<|im_end|>", "é", " "]
    for cut in range(len(valid) + 1):
        parse_assistant(valid[:cut], TOOLS)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        turn = parse_assistant(text, TOOLS)
        assert isinstance(turn.errors, list)

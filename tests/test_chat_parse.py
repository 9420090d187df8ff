"""Parsing generated assistant text: reasoning split, content, every call in order, the parameter grammar,
schema conversion, and malformed output turned into `errors` (never an exception)."""
import json
import random

import pytest

from mercury_jax.chat import parse_assistant, render_completion
from mercury_jax.chat.parse import MAX_CALLS_PER_TURN, MAX_PARAMETERS_PER_CALL, convert_value

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


def not_strict(param: str, text: str) -> list[str]:
    """The call errors for `param` given as `text` (the call also gives the required name)."""
    turn = parse_assistant(call("do", name="a", **{param: text}), TOOLS)
    assert not turn.tool_calls[0].ok and param not in turn.tool_calls[0].arguments
    json.dumps(turn.to_message(), allow_nan=False)
    return turn.tool_calls[0].errors


@pytest.mark.parametrize("param, text, problem", [
    ("tags", "['a', 'b']", "Expecting value"),                     # Python literals were accepted by literal_eval
    ("tags", "('a',)", "Expecting value"),
    ("tags", "{1, 2}", "Expecting property name"),                  # a set
    ("tags", "[b'x']", "Expecting value"),                          # bytes
    ("tags", "[1j]", "Expecting ',' delimiter"),                    # complex
    ("tags", "[...]", "Expecting value"),                           # Ellipsis
    ("tags", "[NaN]", "NaN is not a JSON number"),                  # json.loads takes NaN unless told not to
    ("tags", "[-Infinity]", "-Infinity is not a JSON number"),
    ("tags", "[1e400]", "a number overflows to infinity"),
    ("tags", '["\\ud800"]', "unpaired surrogate"),                   # dumps, but cannot be encoded to re-render
    ("tags", '"a"', "that is a string"),
    ("meta", "{'k': None, 'b': True}", "Expecting property name enclosed in double quotes"),
    ("meta", '{"k": NaN}', "NaN is not a JSON number"),
    ("meta", '{"\\udc00": 1}', "unpaired surrogate"),
    ("meta", "[1]", "that is an array"),
])
def test_values_that_are_not_strict_json_are_call_errors(param, text, problem):
    kind = "array" if param == "tags" else "object"
    [error] = not_strict(param, text)
    assert error.startswith(f"parameter {param!r}: expects an {kind} written as strict JSON (e.g. ")
    assert problem in error.split(": ", 2)[2], error  # the reason follows the quoted value


@pytest.mark.parametrize("text", ["4.5", "-4.5", "4.0000000000000001", "1e-3", "3.14159e2"])
def test_integer_with_a_fraction_is_a_named_error_never_truncated(text):
    """Issue #22: 4.5 for an integer must not become 4 (nor 4.0000000000000001, which is 4.0 as a float)."""
    assert not_strict("count", text) == [
        f"parameter 'count': expects an integer, got {text!r}, which has a fractional part (it is not rounded or "
        f"truncated: write a whole number)"]
    with pytest.raises(ValueError, match="expects an integer"):
        convert_value(text, {"type": "integer"})


@pytest.mark.parametrize("param, text, error", [
    ("count", "+5", "expects an integer (JSON, e.g. 4), got '+5'"),
    ("count", "1_000", "expects an integer (JSON, e.g. 4), got '1_000'"),     # int() takes it; JSON does not
    ("count", "\u0663", "expects an integer (JSON, e.g. 4), got '\u0663'"),   # int() takes non-ASCII digits
    ("count", "07", "expects an integer (JSON, e.g. 4), got '07'"),
    ("count", "True", "expects an integer (JSON, e.g. 4), got 'True'"),
    ("count", "1e5000", "expects an integer of at most 4300 digits, got '1e5000'"),
    ("ratio", "inf", "expects a finite number (JSON, e.g. 2.5), got 'inf'"),
    ("ratio", "Infinity", "expects a finite number (JSON, e.g. 2.5), got 'Infinity'"),
    ("ratio", "1e400", "expects a finite number (JSON, e.g. 2.5), got '1e400'"),
    ("ratio", ".5", "expects a finite number (JSON, e.g. 2.5), got '.5'"),
    ("flag", "TRUE", "expects true or false, got 'TRUE'"),
])
def test_scalars_must_be_json_or_the_templates_own_spelling(param, text, error):
    assert not_strict(param, text) == [f"parameter {param!r}: {error}"]


@pytest.mark.parametrize("marker", ["</tool_call>", "<parameter=", "</parameter>", "</function>"])
def test_stray_call_syntax_in_content_is_a_turn_error(marker):
    error = (f"stray {marker} in the content, outside any <tool_call> block: call syntax belongs inside "
             f"<tool_call>...</tool_call>; write plain text otherwise")
    turn = parse_assistant(f"Done.{marker}x", TOOLS)
    assert (turn.content, turn.tool_calls, turn.errors) == (f"Done.{marker}x", [], [error])
    turn = parse_assistant(f"I will search {marker}\n" + call("search", q="x"), TOOLS)
    assert turn.errors == [error] and [(c.name, c.arguments, c.ok) for c in turn.tool_calls] == [
        ("search", {"q": "x"}, True)]
    reasoning_only = parse_assistant(f"draft {marker}\n</think>\n\nDone.", TOOLS)  # reasoning may rehearse
    assert reasoning_only.errors == []
    assert parse_assistant("a < b and tool_call > parameter; </b>", TOOLS).errors == []


def test_call_and_parameter_limits_are_errors():
    turn = parse_assistant(call("search", q="x") * (MAX_CALLS_PER_TURN + 5), TOOLS)
    assert len(turn.tool_calls) == MAX_CALLS_PER_TURN and all(c.ok for c in turn.tool_calls)
    assert turn.errors == [f"more than {MAX_CALLS_PER_TURN} <tool_call> blocks in one turn: only the first "
                           f"{MAX_CALLS_PER_TURN} are read; make fewer calls per turn"]
    body = "".join(f"<parameter=p{i}>\n{i}\n</parameter>\n" for i in range(MAX_PARAMETERS_PER_CALL + 1))
    [wide] = parse_assistant(f"<tool_call>\n<function=anything>\n{body}</function>\n</tool_call>").tool_calls
    assert wide.errors == [f"more than {MAX_PARAMETERS_PER_CALL} <parameter=...> blocks: only the first "
                           f"{MAX_PARAMETERS_PER_CALL} are read; give each parameter once"]
    assert wide.arguments == {f"p{i}": str(i) for i in range(MAX_PARAMETERS_PER_CALL)}
    repeated = parse_assistant("<tool_call>\n<function=search>\n" + "<parameter=q>\nx\n</parameter>\n" * 3
                               + "</function>\n</tool_call>", TOOLS).tool_calls[0]
    assert repeated.errors == ["parameter 'q' is given more than once"]  # once per name, not per repeat


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


VALID_ARGUMENTS = [{"name": "a", "count": 3, "tags": ["x"]}, {"q": "b"}]
VALID = render_completion({"role": "assistant", "content": "c", "reasoning_content": "r", "tool_calls": [
    {"name": "do", "arguments": VALID_ARGUMENTS[0]}, {"name": "search", "arguments": VALID_ARGUMENTS[1]}]})


def expected_cut(cut: int) -> dict:
    """What parsing VALID[:cut] must give, from the positions of VALID's markers (not from the parser)."""
    think_end = VALID.index("</think>") + len("</think>")
    opens = [i for i in range(len(VALID)) if VALID.startswith("<tool_call>", i)]
    present = [k for k, i in enumerate(opens) if cut >= i + len("<tool_call>")]
    prefix = VALID[:cut]
    if cut < think_end:
        reasoning, content = "", prefix.strip()
    else:
        reasoning, content = "r", ("c" if present else prefix[think_end:].strip())
    calls, turn_errors = [], []
    for k in present:
        function_end = VALID.index("</function>", opens[k]) + len("</function>")
        tool_call_end = VALID.index("</tool_call>", opens[k]) + len("</tool_call>")
        name_open_end = VALID.index("<function=", opens[k]) + len("<function=")
        name_close = VALID.index(">", name_open_end)
        if cut >= tool_call_end or function_end <= cut <= function_end + 1:
            calls.append((True, VALID_ARGUMENTS[k]))
        elif cut < name_open_end:
            calls.append((False, "no <function=NAME>"))
        elif cut <= name_close:
            calls.append((False, "not closed with '>'"))
        elif cut < function_end:
            calls.append((False, "the call is cut off"))
        else:
            calls.append((False, "text after </function>"))
        if k == present[-1] and cut >= tool_call_end:
            tail = "" if cut == len(VALID) else prefix[tool_call_end:]  # the whole <|im_end|> is stripped
            if tail.strip():
                turn_errors.append(f"text after the last </tool_call>: {tail.strip()!r}")
    return {"reasoning": reasoning, "content": content, "calls": calls, "turn_errors": turn_errors}


def test_every_truncation_of_a_valid_turn_parses_to_what_its_markers_say():
    assert VALID.endswith("</tool_call><|im_end|>") and VALID.count("<tool_call>") == 2
    for cut in range(len(VALID) + 1):
        turn, expected = parse_assistant(VALID[:cut], TOOLS), expected_cut(cut)
        assert (turn.reasoning, turn.content) == (expected["reasoning"], expected["content"]), cut
        assert len(turn.tool_calls) == len(expected["calls"]), cut
        for call, (ok, what) in zip(turn.tool_calls, expected["calls"]):
            assert call.ok == ok, (cut, call.errors)
            if ok:
                assert call.arguments == what and type(call.arguments["name" if "name" in what else "q"]) is str
            else:
                assert what in call.errors[0], (cut, call.errors)
        assert [e for e in turn.errors if not e.startswith("tool call ")] == expected["turn_errors"], cut
        assert len(turn.errors) == len(expected["turn_errors"]) + sum(len(c.errors) for c in turn.tool_calls)
    full = parse_assistant(VALID, TOOLS)
    assert full.errors == [] and [c.arguments for c in full.tool_calls] == VALID_ARGUMENTS


# Values a model may write for a typed parameter: JSON, Python spellings, and what breaks JSON or rendering.
FUZZ_VALUES = ["7", "-0", "4.0", "4.5", "4.0000000000000001", "1e3", "1e400", "-1e400", "1e-999999", "+5", "1_000",
               "\u0663", "0x10", "07", "2.5", ".5", "nan", "NaN", "inf", "Infinity", "-Infinity", "true", "True",
               "TRUE", "false", "None", "null", '"s"', "'s'", "[1, 2]", "[1, 'a']", "(1,)", "{1, 2}", "{'a': 1}",
               '{"a": 1}', '{"a": NaN}', '{"a": 1e999}', '{"a": [1, {"b": null}]}', '["\\ud800"]',
               '["\\ud83d\\ude00"]', '{"\\udc00": 1}', "b'x'", "[b'x']", "1j", "[1j]", "...", "[...]", "Ellipsis",
               "[" * 3000, "9" * 5000, "", " ", "\n", "[]", "{}", "x", "\u00e9t\u00e9", "[1e309]", "[-0.0]"]
FUZZ_PIECES = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">",
               "\n", "<think>", "</think>", "do", "search", "q", "{", "[", "None", "<|im_end|>", "\u00e9", " ",
               "count", "NaN", "1e400", "(1,)"]


def fuzzed_turn(rng: random.Random) -> str:
    parts = [rng.choice(["", "plan\n</think>\n\n", "<think>\nplan\n</think>\n"]), rng.choice(["", "Calling.", "x"])]
    for _ in range(rng.randint(0, 3)):
        tool = rng.choice(["do", "search", "mcp_style", "nope"])
        names = rng.sample(list(SCHEMA["properties"]) + ["q", "n", "extra"], rng.randint(0, 4))
        body = "".join(f"<parameter={n}>\n{rng.choice(FUZZ_VALUES)}\n" + rng.choice(["</parameter>\n", ""])
                       for n in names)
        parts.append(f"\n<tool_call>\n<function={tool}>\n{body}</function>\n" + rng.choice(["</tool_call>", ""]))
    if rng.random() < 0.3:
        parts.append("".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 30))))
    return "".join(parts)


def test_every_parsed_turn_is_strict_json_and_ok_calls_round_trip():
    """Property over 3,000 seeded fuzzed turns (and 1,000 of raw marker soup): the parsed message survives
    json.dumps(allow_nan=False) unchanged (no tuple, set, bytes, complex, Ellipsis, NaN, inf) and encodes as
    UTF-8 (no unpaired surrogate); every executable call re-renders and re-parses to the same arguments."""
    rng = random.Random(0)
    texts = [fuzzed_turn(rng) for _ in range(3000)]
    texts += ["".join(rng.choice(FUZZ_PIECES + FUZZ_VALUES[:20]) for _ in range(rng.randint(0, 40)))
              for _ in range(1000)]
    ok_calls = rejected = 0
    for text in texts:
        for tools in (TOOLS, None):
            turn = parse_assistant(text, tools)
            message = turn.to_message()
            dumped = json.dumps(message, allow_nan=False, ensure_ascii=False)
            assert json.loads(dumped) == message, text
            dumped.encode("utf-8")
            good = [c for c in turn.tool_calls if c.ok]
            ok_calls += len(good)
            rejected += sum(any("strict JSON" in e or "expects" in e for e in c.errors) for c in turn.tool_calls)
            if good:
                again = parse_assistant(render_completion({"role": "assistant", "content": "", "tool_calls": [
                    {"name": c.name, "arguments": c.arguments} for c in good]}), tools)
                assert again.errors == [] and [c.arguments for c in again.tool_calls] == [c.arguments for c in good]
    assert ok_calls > 300 and rejected > 300  # both sides of the property are exercised

"""Rendering: each Qwen3.5 chat-format rule, and the built-in renderer against a jinja template written from the
same rules, rendered by our jinja path and by transformers' own `render_jinja_template`."""
import json

import pytest

from mercury_jax.chat import BUILTIN_CHAT_TEMPLATE, load_chat_template, render, render_chat_template, render_completion
from mercury_jax.chat.render import TOOLS_INSTRUCTIONS

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city (°C).",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "days": {"type": "integer"}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "send_email", "description": "Send an email.",
                                      "parameters": {"type": "object", "properties": {
                                          "to": {"type": "array", "items": {"type": "string"}},
                                          "body": {"type": "string"}, "urgent": {"type": "boolean"},
                                          "cc": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}},
]
CALL_PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
CALL_EMAIL = {"type": "function", "function": {"name": "send_email", "arguments": json.dumps(
    {"to": ["a@x.org", "b@y.org"], "body": "Line one\nLine two", "urgent": True, "cc": None})}}


def test_plain_turns_trimmed_with_generation_prompt():
    text = render([{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "\nHi there \n"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")


def test_generation_prompt_with_thinking_off_and_none():
    messages = [{"role": "user", "content": "Hi"}]
    assert render(messages, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(messages, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_tools_block_precedes_the_system_text():
    text = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools\n\n")
    lines = system.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in lines] == TOOLS
    assert "°C" in system  # tools are JSON without ASCII escaping, like transformers' tojson
    assert system.endswith(TOOLS_INSTRUCTIONS + "\n\nBe brief.")
    no_system = render([{"role": "user", "content": "Hi"}], TOOLS)
    assert no_system.split("<|im_end|>")[0].endswith(TOOLS_INSTRUCTIONS)


def test_tool_calls_in_xml_form_and_merged_tool_results():
    messages = [{"role": "user", "content": "Weather, then mail it"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [CALL_PARIS, CALL_EMAIL]},
                {"role": "tool", "content": "sunny"}, {"role": "tool", "content": " sent \n"}]
    text = render(messages, TOOLS, add_generation_prompt=False)
    assert text.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=send_email>\n<parameter=to>\n[\"a@x.org\", \"b@y.org\"]\n</parameter>\n"
        "<parameter=body>\nLine one\nLine two\n</parameter>\n<parameter=urgent>\nTrue\n</parameter>\n"
        "<parameter=cc>\nNone\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nsent\n</tool_response>"
        "<|im_end|>\n")


def test_tool_call_without_content_has_no_blank_line():
    text = render([{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                      "tool_calls": [CALL_PARIS]}], add_generation_prompt=False)
    assert "<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>" in text


def test_reasoning_kept_after_the_last_query_and_dropped_before():
    messages = [{"role": "user", "content": "first"},
                {"role": "assistant", "content": "A1", "reasoning_content": "old thought"},
                {"role": "user", "content": "second"},
                {"role": "assistant", "content": "<think>\nnew thought\n</think>\n\nA2", "tool_calls": [CALL_PARIS]},
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "Done.", "reasoning": "wrap up"}]
    text = render(messages, add_generation_prompt=False)
    assert "<|im_start|>assistant\nA1<|im_end|>" in text and "old thought" not in text
    assert "<|im_start|>assistant\n<think>\nnew thought\n</think>\n\nA2\n\n<tool_call>" in text
    assert "<|im_start|>assistant\n<think>\nwrap up\n</think>\n\nDone.<|im_end|>" in text


def test_user_turn_of_only_tool_responses_is_not_a_query():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
                {"role": "user", "content": "<tool_response>\nx\n</tool_response>"}]
    assert "<think>\nr\n</think>" in render(messages)


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "q"}, {"role": "system", "content": "late"}], "system"),
    ([{"role": "system", "content": "s"}], "no user query"),
    ([{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}], "role"),
    ([], "at least one"),
])
def test_invalid_chats_are_rejected(messages, match):
    with pytest.raises(ValueError, match=match):
        render(messages)
    if messages:
        import jinja2
        with pytest.raises(jinja2.TemplateError):
            render(messages, chat_template=BUILTIN_CHAT_TEMPLATE)


CHATS = [
    ([{"role": "user", "content": "Hi"}], None),
    ([{"role": "system", "content": "Sys"}, {"role": "user", "content": " Hi "}], TOOLS),
    ([{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}]}], TOOLS),
    ([{"role": "system", "content": "Sys"}, {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [CALL_PARIS, CALL_EMAIL]},
      {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "sent"},
      {"role": "assistant", "content": "Sunny; mailed."}, {"role": "user", "content": "Thanks"},
      {"role": "assistant", "content": "<think>\nhm\n</think>\n\nYou're welcome!"}], TOOLS),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x", "tool_calls": [
        {"name": "f", "arguments": {"nested": {"k": [1, 2.5, None, False]}, "n": 1.5, "s": "ünï", "e": ""}}]},
      {"role": "tool", "content": "r"}], None),
]


@pytest.mark.parametrize("messages, tools", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_builtin_renderer_equals_its_jinja_template(messages, tools, add_generation_prompt, enable_thinking):
    kwargs = dict(add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    ours = render(messages, tools, **kwargs)
    assert render(messages, tools, chat_template=BUILTIN_CHAT_TEMPLATE, **kwargs) == ours
    # transformers' renderer (it does not decode JSON-string arguments: give it dicts)
    from transformers.utils.chat_template_utils import render_jinja_template

    plain = [dict(m, tool_calls=[{"function": {"name": c.get("function", c)["name"],
                                               "arguments": _as_dict(c.get("function", c)["arguments"])}}
                                 for c in m["tool_calls"]]) if m.get("tool_calls") else m for m in messages]
    rendered, _ = render_jinja_template([plain], tools=tools, chat_template=BUILTIN_CHAT_TEMPLATE, **kwargs)
    assert (rendered[0] if isinstance(rendered, list) else rendered) == ours


def _as_dict(arguments):
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def test_checkpoint_template_is_used_when_given(tmp_path):
    wording = "Reply with <tool_call> blocks (checkpoint wording)."
    template = BUILTIN_CHAT_TEMPLATE.replace(json.dumps(TOOLS_INSTRUCTIONS)[1:-1], wording)
    assert template != BUILTIN_CHAT_TEMPLATE
    (tmp_path / "jinja").mkdir()
    (tmp_path / "jinja" / "chat_template.jinja").write_text(template)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "named").mkdir()
    (tmp_path / "named" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "rag", "template": "x"}, {"name": "default", "template": template}]}))
    (tmp_path / "none").mkdir()
    assert load_chat_template(tmp_path / "none") is None
    messages, tools = CHATS[3]
    expected = render(messages, tools).replace(TOOLS_INSTRUCTIONS, wording)
    for sub in ("jinja", "config", "named"):
        loaded = load_chat_template(tmp_path / sub)
        assert loaded == template
        assert render(messages, tools, chat_template=loaded) == expected


def test_jinja_path_supports_generation_blocks_and_transformers_globals():
    template = ("{% for m in messages %}{% generation %}{{ m.content|tojson }}{% endgeneration %}{% endfor %}"
                "{{ raise_exception('boom') if messages|length > 5 else '' }}{{ strftime_now('%Y')|length }}")
    assert render_chat_template(template, [{"role": "user", "content": "<é>"}]) == '"<é>"4'


def test_render_completion_is_the_tail_of_the_rendered_turn():
    history = [{"role": "user", "content": "Weather?"}]
    for thinking in (True, False):
        turn = {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL_PARIS]}
        if thinking:
            turn["reasoning_content"] = "Need the tool."
        prompt = render(history, TOOLS, enable_thinking=thinking)
        completion = render_completion(turn, enable_thinking=thinking)
        assert prompt + completion + "\n" == render(history + [turn], TOOLS, add_generation_prompt=False)
        assert completion.endswith("</tool_call><|im_end|>")
    with pytest.raises(ValueError, match="thinking off"):
        render_completion({"role": "assistant", "content": "x", "reasoning_content": "r"}, enable_thinking=False)

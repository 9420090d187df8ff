"""Checkpoint chat templates through jinja2, the way transformers renders them, and our own template.

Real checkpoints ship their `chat_template` (in `chat_template.jinja` or `tokenizer_config.json`); rendering it
here with transformers' jinja environment (sandboxed, `trim_blocks`/`lstrip_blocks`, `loopcontrols`, a
`tojson` that does not escape HTML, `raise_exception`, `strftime_now`, `{% generation %}` blocks) lets training
see exactly the model's pre-training format without importing transformers.

`BUILTIN_CHAT_TEMPLATE` restates the built-in renderer (`render.py`) as a jinja template, to ship with checkpoints
trained here so that transformers, vLLM and SGLang render the same prompts; the tests hold the two equal.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mercury_jax.chat.tools_block import TOOLS_FOOTER, TOOLS_HEADER, TOOLS_INSTRUCTIONS, normalize_tool_call


def load_chat_template(path: str | Path) -> str | None:
    """The chat template of a checkpoint directory (`chat_template.jinja`, else `tokenizer_config.json`'s
    `chat_template`, the "default" one when it is a list), or None when it ships none."""
    path = Path(path)
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    config_file = path / "tokenizer_config.json"
    if config_file.exists():
        template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, list):
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return template
    return None


def render_chat_template(chat_template: str, messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None = None, *, add_generation_prompt: bool = True,
                         enable_thinking: bool = True, **template_kwargs: Any) -> str:
    """Render `messages` with a jinja chat template; tool-call arguments given as JSON strings become dicts
    and `reasoning` / `thinking` are aliased to `reasoning_content` (as transformers does) first."""
    compiled = _compile(chat_template)
    return compiled.render(messages=[_template_message(m) for m in messages], tools=list(tools) if tools else None,
                           documents=None, add_generation_prompt=add_generation_prompt,
                           enable_thinking=enable_thinking, **template_kwargs)


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(dict(message), default=_plain))  # a plain copy; the template cannot mutate ours
    reasoning = next((out[k] for k in ("reasoning_content", "thinking", "reasoning") if out.get(k) is not None),
                     None)
    if reasoning is not None:
        out["reasoning_content"] = out["thinking"] = reasoning
    if out.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": normalize_tool_call(c)} for c in message["tool_calls"]]
    return out


def _plain(value: Any) -> Any:
    if hasattr(value, "name") and hasattr(value, "arguments"):
        return {"name": value.name, "arguments": value.arguments}
    raise TypeError(f"cannot pass {type(value).__name__} to a chat template")


@functools.lru_cache(maxsize=16)
def _compile(chat_template: str):
    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for masks; here it renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(chat_template)


def _jinja_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid jinja string literal


BUILTIN_CHAT_TEMPLATE = (r"""{%- macro text(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for part in content %}
            {%- if part is string %}
                {{- part }}
            {%- elif 'text' in part %}
                {{- part.text }}
            {%- else %}
                {{- raise_exception('only text content can be rendered') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is not none and content is defined %}
        {{- raise_exception('unexpected content type') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('render needs at least one message') }}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_text = text(messages[0].content)|trim %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' + """ + _jinja_string(TOOLS_HEADER) + r""" }}
    {%- for tool in tools %}
        {{- '\n' + tool|tojson }}
    {%- endfor %}
    {{- """ + _jinja_string(TOOLS_FOOTER + TOOLS_INSTRUCTIONS) + r""" }}
    {%- if system_text %}
        {{- '\n\n' + system_text }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages[::-1] %}
    {%- if ns.last_query < 0 and message.role == 'user' %}
        {%- set query = text(message.content)|trim %}
        {%- if not (query.startswith('<tool_response>') and query.endswith('</tool_response>')) %}
            {%- set ns.last_query = messages|length - 1 - loop.index0 %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.last_query < 0 %}
    {{- raise_exception('no user query found in messages') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = text(message.content)|trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('only the first message may be a system message') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- else %}
            {%- set reasoning = '' %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning|trim + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {%- if not loop.first %}
                {{- '\n' }}
            {%- elif content|trim %}
                {{- '\n\n' }}
            {%- endif %}
            {{- '<tool_call>\n<function=' + call.name + '>\n' }}
            {%- for name, value in (call.arguments or {})|items %}
                {%- if value is mapping or (value is sequence and value is not string) %}
                    {{- '<parameter=' + name + '>\n' + value|tojson + '\n</parameter>\n' }}
                {%- else %}
                    {{- '<parameter=' + name + '>\n' + value|string + '\n</parameter>\n' }}
                {%- endif %}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if not loop.first and loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unexpected message role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""")

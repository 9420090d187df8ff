"""The text path of an agent: tokenizers, Qwen3.5 chat rendering, tool-call parsing, observation tokens.

    render(messages, tools=None, *, add_generation_prompt=True, enable_thinking=True) -> str
    chat_ids(tokenizer, messages, tools=None, ...) -> list[int]   # render's ids; message text never a control id
    parse_assistant(text, tools=None) -> AssistantTurn   # .reasoning .content .tool_calls[i].name/.arguments .errors
    qwen35_tokenizer() -> Qwen35Tokenizer                # .encode(str) -> list[int], .decode(list[int]) -> str
"""
from mercury_jax.chat.chat_ids import chat_ids, completion_ids
from mercury_jax.chat.observation import observation_ids
from mercury_jax.chat.parse import AssistantTurn, ToolCall, parse_assistant
from mercury_jax.chat.render import generation_prompt, render, render_completion
from mercury_jax.chat.sentencepiece_tokenizer import SentencePieceTokenizer, train_sentencepiece_tokenizer
from mercury_jax.chat.special_tokens import SPECIAL_TOKENS
from mercury_jax.chat.template import BUILTIN_CHAT_TEMPLATE, load_chat_template, render_chat_template
from mercury_jax.chat.tokenizer import Qwen35Tokenizer, Tokenizer, qwen35_tokenizer

__all__ = [
    "AssistantTurn", "BUILTIN_CHAT_TEMPLATE", "Qwen35Tokenizer", "SPECIAL_TOKENS", "SentencePieceTokenizer",
    "Tokenizer", "ToolCall", "chat_ids", "completion_ids", "generation_prompt", "load_chat_template",
    "observation_ids", "parse_assistant", "qwen35_tokenizer", "render", "render_chat_template", "render_completion",
    "train_sentencepiece_tokenizer",
]

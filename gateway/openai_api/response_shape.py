"""How one OpenAI request's response is shaped, decided once from its body.

The formatter (``gateway/openai_api/format.py``) reads this instead of the body, so the body
models own parsing and the formatter owns layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResponseShape:
    chat: bool
    request_id: str = ""  # the response's id (a prompt list's requests are "{id}-{p}")
    n: int = 1  # choices per prompt: choice i of prompt p is index p * n + i
    stream: bool = False
    include_usage: bool = False  # stream: a last chunk with the summed usage
    continuous_usage: bool = False  # stream: usage (so far) on every chunk
    prompts: int = 1
    # completions echo: the prompt's text (and, with logprobs, its tokens' logprobs)
    # before each choice's text; the text is the prompt's own when it was a string, else
    # the worker's decoding of its token ids (``prompt_text`` on the first event)
    echo: bool = False
    echo_texts: list[str | None] = field(default_factory=list)
    chat_echo: str | None = None  # chat echo: the last (assistant) message's content
    generate: bool = True  # False: max_tokens 0 with echo; the one generated token is dropped
    token_ids_as_text: bool = False  # vLLM's return_tokens_as_token_ids
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in each choice
    tools: tuple[str, ...] = ()  # chat: the functions the output may call (parsed back)

    def index(self, prompt: int, choice: int) -> int:
        return prompt * self.n + choice

    @property
    def choices(self) -> int:
        return self.prompts * self.n

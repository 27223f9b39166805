"""Tools and tool turns in the prompt: through a tool-aware template, and the documented
fallback for a template that knows none (the default model's); docs/tools.md."""

from __future__ import annotations

from typing import Any

from protocol.models import ChatMessage
from protocol.sampling import SamplingParams
from protocol.structured.constraint import StructuredOutput
from protocol.structured.tool_syntax import detect_syntax
from protocol.structured.tools import FunctionTool, ToolCall, ToolCalls
from worker.engine.inputs.prompts import PromptBuilder, PromptLimits
from worker.engine.inputs.tool_prompts import FALLBACK_INTRO, knows_tools

# a Qwen-like template: tools in the system turn, calls as <tool_call> blocks
HERMES_TEMPLATE = (
    "{% if tools %}<|system|>TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
    "<|end|>{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}"
    "{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = ToolCalls(tools=[FunctionTool(name="get_weather", description="Weather.",
                                      parameters={"type": "object", "properties": {
                                          "city": {"type": "string"}}})], mode="auto")
HISTORY = [
    ChatMessage(role="user", content="Weather in Paris?"),
    ChatMessage(role="assistant", content="", tool_calls=[
        ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')]),
    ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
]


def _render(tokenizer: Any) -> str:
    builder = PromptBuilder(tokenizer, PromptLimits(vocab_size=len(tokenizer),
                                                    max_model_len=4096, num_blocks=512,
                                                    block_size=16))
    params = SamplingParams(max_tokens=8, structured_output=StructuredOutput(tools=TOOLS))
    ids = builder.build(messages=[m.model_dump() for m in HISTORY], params=params)
    return str(tokenizer.decode(ids))


def test_a_tool_aware_template_gets_tools_and_turns() -> None:
    from tests.checkpoints import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = HERMES_TEMPLATE
    assert knows_tools(tok.chat_template) and detect_syntax(tok.chat_template) == "hermes"
    text = _render(tok)
    assert "TOOLS:get_weather;" in text
    assert '<tool_call>get_weather{"city": "Paris"}</tool_call>' in text  # an object
    assert "sunny[call_1]" in text


def test_the_default_model_gets_the_fallback() -> None:
    from transformers import AutoTokenizer

    from worker.models import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    assert not knows_tools(tok.chat_template) and detect_syntax(tok.chat_template) == "hermes"
    text = _render(tok)
    assert text.index("### system\n" + FALLBACK_INTRO) < text.index("### user")
    assert '"name": "get_weather"' in text  # the signature, in <tools>
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           "</tool_call>" in text
    assert "### tool\nsunny" in text


def test_no_tools_renders_as_before() -> None:
    from transformers import AutoTokenizer

    from worker.models import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    builder = PromptBuilder(tok, PromptLimits(vocab_size=len(tok), max_model_len=4096,
                                              num_blocks=512, block_size=16))
    messages = [{"role": "user", "content": "hi"}]
    plain = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
    wire = [ChatMessage(role="user", content="hi").model_dump()]
    assert builder.build(messages=wire) == list(plain)

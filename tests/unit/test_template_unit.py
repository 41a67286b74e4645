"""ChatTemplate's guards: which requests it renders, BOS/EOS stripping, the parity verdict."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from proxy.tokenizer.template import ChatTemplate, check_template_parity, parity_conversations, probe_template

pytestmark = pytest.mark.unit

SOURCE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _template(**kw: bool) -> ChatTemplate:
    return ChatTemplate(SOURCE, "<s>", "</s>", add_bos=kw.get("add_bos", False), add_eos=False)


def test_plain_requests_only() -> None:
    t = _template()
    user = {"role": "user", "content": "hi"}
    assert (
        t.render({"messages": [user], "max_tokens": 3, "stream": True})
        == "<s><|user|>hi<|end|>\n<|assistant|>"
    )
    assert t.render({"messages": [user], "tools": []}) is None  # a field that reaches the template
    assert t.render({"messages": [user], "add_generation_prompt": False}) is None
    assert t.render({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}) is None
    assert t.render({"messages": [{"role": "tool", "content": "x"}]}) is None
    assert t.render({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}) is None
    assert t.render({"messages": [user, {"role": "assistant", "content": "Sure"}]}) is None  # a prefill
    assert t.render({"messages": []}) is None


def test_bos_stripped_when_the_vocab_adds_it() -> None:
    assert _template(add_bos=True).render({"messages": [{"role": "user", "content": "a"}]}) == (
        "<|user|>a<|end|>\n<|assistant|>"
    )


def test_a_template_that_raises_goes_to_the_server() -> None:
    t = ChatTemplate("{{ raise_exception('no') }}", add_bos=False, add_eos=False)
    assert t.render({"messages": [{"role": "user", "content": "a"}]}) is None


def test_unknown_templates() -> None:
    assert ChatTemplate.unknown_reason(SOURCE) == ""
    assert "strftime_now" in ChatTemplate.unknown_reason("{{ strftime_now('%d') }}" + SOURCE)
    assert "enable_thinking" in ChatTemplate.unknown_reason("{% if enable_thinking %}{% endif %}")
    assert ChatTemplate.unknown_reason("knowledge and unknown words") == ""  # whole words only
    assert ChatTemplate.unknown_reason("") != ""


def _remote(template: ChatTemplate) -> Callable[[list[dict[str, str]]], Awaitable[str]]:
    async def remote(messages: list[dict[str, str]]) -> str:
        return template.render_messages(messages)

    return remote


def test_parity_passes_only_when_equal() -> None:
    same = asyncio.run(check_template_parity(_template(), _remote(_template())))
    assert same.ok and same.checked == len(parity_conversations())
    other = ChatTemplate(
        SOURCE.replace("m['content']", "m['content'] | trim"), "<s>", "</s>", add_bos=False, add_eos=False
    )
    differ = asyncio.run(check_template_parity(_template(), _remote(other)))
    assert not differ.ok and differ.mismatches


def test_probe_falls_back_on_mismatch() -> None:
    other = ChatTemplate(SOURCE + " ", "<s>", "</s>", add_bos=False, add_eos=False)
    probe = asyncio.run(probe_template(SOURCE, "<s>", "</s>", False, False, _remote(other)))
    assert probe.template is None and probe.note.startswith("server (")
    kept = asyncio.run(probe_template(SOURCE, "<s>", "</s>", False, False, _remote(_template())))
    assert kept.template is not None and kept.note == "local"

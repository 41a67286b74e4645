"""The chat template rendered in the proxy, kept only where it renders exactly as the server.

llama-server renders a chat request's messages with the model's Jinja template (its own
engine, ``common/jinja``, with ``trim_blocks`` and ``lstrip_blocks`` on), then drops a
leading BOS text / trailing EOS text when the vocab adds those tokens itself. Asking the
server (``POST /apply-template``) costs a local HTTP round trip per request, most of the
proxy's overhead on a miss. :class:`ChatTemplate` renders the same template with ``jinja2``
instead, under three guards:

- the template is *known*: nothing in its source depends on the clock, on reasoning or
  thinking switches, or on anything else the server may set that the proxy cannot see
  (:data:`RISKY_SOURCE`);
- the request has the *plain shape*: messages with role system/user/assistant and string
  content only, the last not an assistant's (the server continues that one instead), and
  no body field that reaches the template (tools, response formats, template kwargs...):
  only :data:`PLAIN_BODY_KEYS`;
- the *parity check* (:func:`check_template_parity`) at startup renders a corpus of plain
  conversations both ways and requires byte-equal prompts.

Anything else (unknown template, other shape, a render error, parity failed) goes to the
server's ``/apply-template``, which is always right.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.tokenizer.parity import CORPUS

__all__ = [
    "PLAIN_BODY_KEYS",
    "RISKY_SOURCE",
    "ChatTemplate",
    "TemplateParity",
    "TemplateProbe",
    "check_template_parity",
    "parity_conversations",
    "probe_template",
]

#: The server's ``POST /apply-template`` for a body with these messages.
RemoteApply = Callable[[list[dict[str, str]]], Awaitable[str]]

ROLES = frozenset({"system", "user", "assistant"})
#: Body fields that never reach the template (sampling, streaming, the proxy's own): a body
#: with any other field is rendered by the server.
PLAIN_BODY_KEYS = frozenset(
    {
        "messages",
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "n_predict",
        "n",
        "temperature",
        "dynatemp_range",
        "dynatemp_exponent",
        "top_p",
        "top_k",
        "min_p",
        "typical_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "repeat_penalty",
        "repeat_last_n",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "n_probs",
        "ignore_eos",
        "cache_prompt",
        "cache_salt",
        "id_slot",
        "user",
        "timings_per_token",
        "return_progress",
        "samplers",
        "post_sampling_probs",
    }
)
#: Names in a template's source that make its rendering depend on what the proxy cannot see
#: (the clock, the server's reasoning and thinking settings, template kwargs).
RISKY_SOURCE = (
    "strftime_now",
    "datetime",
    "date_string",
    "now",
    "enable_thinking",
    "thinking",
    "reasoning",
    "reasoning_content",
    "reasoning_effort",
    "preserve_reasoning",
    "builtin_tools",
    "custom_tools",
    "documents",
)
_RISKY = re.compile(r"\b(" + "|".join(RISKY_SOURCE) + r")\b")


class _TemplateRaised(Exception):
    """The template called ``raise_exception`` (the server answers that request itself)."""


def _raise(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # As transformers' chat templates have it (no HTML escaping, UTF-8 kept).
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """One model's chat template rendered with ``jinja2`` (see the module docstring)."""

    def __init__(
        self, source: str, bos_token: str = "", eos_token: str = "", *, add_bos: bool, add_eos: bool
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos, self.add_eos = add_bos, add_eos
        self._template = env.from_string(source)

    @staticmethod
    def unknown_reason(source: str) -> str:
        """Why a template is not rendered locally at all ("" when it may be)."""
        if not source.strip():
            return "the server reports no chat template"
        risky = sorted(set(_RISKY.findall(source)))
        return f"the template uses {', '.join(risky)}" if risky else ""

    @staticmethod
    def plain(body: Mapping[str, Any]) -> list[dict[str, str]] | None:
        """The messages of a plain-shaped request (see the module docstring), else None."""
        if not PLAIN_BODY_KEYS.issuperset(body):
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        for msg in messages:
            if (
                not isinstance(msg, dict)
                or len(msg) != 2
                or msg.get("role") not in ROLES
                or not isinstance(msg.get("content"), str)
            ):
                return None
        if messages[-1]["role"] == "assistant":
            return None  # the server continues the assistant's message (prefill)
        return messages

    def render_messages(self, messages: list[dict[str, str]]) -> str:
        """The prompt for ``messages`` with the generation prompt, as the server renders it.
        Raises ``jinja2.TemplateError`` or ``_TemplateRaised`` when the template refuses."""
        text = self._template.render(
            messages=messages,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            add_generation_prompt=True,
        )
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text

    def render(self, body: Mapping[str, Any]) -> str | None:
        """The prompt of a chat request, or None when the server must render it."""
        messages = self.plain(body)
        if messages is None:
            return None
        try:
            return self.render_messages(messages)
        except (jinja2.TemplateError, _TemplateRaised, TypeError, ValueError):
            return None


# --------------------------------------------------------------------------------------------------
# Parity against the server
# --------------------------------------------------------------------------------------------------


def parity_conversations(corpus: Iterable[str] = CORPUS) -> list[list[dict[str, str]]]:
    """Plain conversations that exercise the template: every corpus text as a user message
    alone and after a system prompt, multi-turn histories, empty and whitespace-edged
    contents, and contents that look like template or special-token syntax."""
    texts = [t for t in corpus if t]
    edge = [
        "",
        " ",
        "\n",
        " padded ",
        "\n\nnewlines\n\n",
        "\u00a0nbsp\u3000",
        "{{ x }} {% if %}",
        "<|im_end|>",
    ]
    convs: list[list[dict[str, str]]] = []
    for i, text in enumerate(texts):
        convs.append([{"role": "user", "content": text}])
        if i % 3 == 0:
            convs.append([{"role": "system", "content": texts[-1 - i]}, {"role": "user", "content": text}])
    for text in edge:
        convs.append([{"role": "user", "content": text}])
        convs.append([{"role": "system", "content": text}, {"role": "user", "content": "hi"}])
    turns = ["Hello!", "Hi, how can I help?", "Tell me a joke.", "Why did the chicken cross the road?"]
    convs.append(
        [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(turns[:3])]
    )
    convs.append(
        [{"role": "system", "content": "Be brief."}]
        + [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(turns[:3])]
    )
    convs.append([{"role": "assistant", "content": "I start."}, {"role": "user", "content": "Go on."}])
    convs.append(
        [
            {"role": "system", "content": "a"},
            {"role": "system", "content": "b"},
            {"role": "user", "content": "c"},
        ]
    )
    return convs


@dataclass
class TemplateParity:
    ok: bool
    checked: int = 0
    mismatches: list[str] = field(default_factory=list)  # one line per conversation
    errors: list[str] = field(default_factory=list)


async def check_template_parity(
    template: ChatTemplate,
    remote: RemoteApply,
    conversations: Iterable[list[dict[str, str]]] | None = None,
    *,
    concurrency: int = 4,
    max_reported: int = 5,
) -> TemplateParity:
    """Render each conversation locally and with ``remote`` (the server's /apply-template);
    ``ok`` only when every one is byte-equal. A conversation the local template refuses
    while the server renders it counts as a mismatch; one both refuse is skipped."""
    convs = list(conversations if conversations is not None else parity_conversations())
    sem = asyncio.Semaphore(max(1, concurrency))

    async def one(conv: list[dict[str, str]]) -> str | BaseException:
        async with sem:
            try:
                return await remote(conv)
            except Exception as exc:  # reported, not raised
                return exc

    remotes = await asyncio.gather(*(one(c) for c in convs))
    result = TemplateParity(ok=True, checked=len(convs))
    for conv, rem in zip(convs, remotes, strict=True):
        try:
            loc: str | BaseException = template.render_messages(conv)
        except Exception as exc:
            loc = exc
        if isinstance(rem, BaseException) and isinstance(loc, BaseException):
            continue  # both refuse (a template that raises on this shape): the server answers it
        if isinstance(rem, BaseException) or isinstance(loc, BaseException) or loc != rem:
            result.ok = False
            if len(result.mismatches) < max_reported:
                result.mismatches.append(f"{_short(conv)}: local {_short(loc)} != server {_short(rem)}")
    return result


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:160] + "..."


@dataclass(frozen=True)
class TemplateProbe:
    """What :func:`probe_template` found: the template to render locally (None: the server's)."""

    template: ChatTemplate | None
    reason: str = ""  # why not local ("" when local)
    parity: TemplateParity | None = None

    @property
    def note(self) -> str:
        """One line for /radix/stats and `radixctl up`: ``local``, or ``server (why)``."""
        return "local" if self.template is not None else f"server ({self.reason})"


async def probe_template(
    source: str, bos_token: str, eos_token: str, add_bos: bool, add_eos: bool, remote: RemoteApply
) -> TemplateProbe:
    """Keep a local :class:`ChatTemplate` only for a known template that passes parity."""
    why = ChatTemplate.unknown_reason(source)
    if why:
        return TemplateProbe(None, why)
    try:
        template = ChatTemplate(source, bos_token, eos_token, add_bos=add_bos, add_eos=add_eos)
    except jinja2.TemplateError as exc:
        return TemplateProbe(None, f"jinja2 cannot parse the template: {exc}")
    parity = await check_template_parity(template, remote)
    if not parity.ok:
        return TemplateProbe(None, f"{len(parity.mismatches)}+ parity mismatches", parity)
    return TemplateProbe(template, parity=parity)

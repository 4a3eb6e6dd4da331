"""``ChatTemplate``: a tokenizer's Jinja chat template, rendered as ``transformers`` renders it.

The template is the ``chat_template`` of a ``tokenizer_config.json`` (or the
``chat_template.jinja`` file beside it). It is compiled as
``transformers.PreTrainedTokenizerBase.apply_chat_template`` compiles it: a
``jinja2`` **sandboxed**, immutable environment (a template from a downloaded
file never runs code of its own), ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception(message)``, ``strftime_now(format)``,
a ``tojson`` that does not escape HTML, and the ``{% generation %}`` tag that
marks the text an assistant writes. The template reads ``messages``,
``add_generation_prompt``, ``tools``, ``documents`` and the tokenizer's special
tokens (``bos_token``, ``eos_token``, ...) as strings.

:meth:`ChatTemplate.assistant_spans` finds the characters of each assistant
turn in a rendered conversation: the ``{% generation %}`` blocks when the
template has them, else by rendering the conversation prefix by prefix (the
text a turn adds after the generation prompt), checked to be a prefix of the
whole rendering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

# the special tokens transformers hands a template (its special_tokens_map), as strings
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """A chat template that failed to render, or a conversation it cannot mark."""


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """The compiled template, in the sandboxed environment of transformers'
    ``_compile_jinja_template``."""
    import jinja2  # a dependency of dew-data; imported here, when a template is compiled
    import jinja2.ext
    import jinja2.sandbox as sandbox

    class AssistantTracker(jinja2.ext.Extension):
        """``{% generation %} ... {% endgeneration %}``: records the characters of the
        block in the rendering (transformers' extension of the same name)."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._blocks = None
            self._spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_generation_support")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller):
            text = caller()
            if self._spans is not None:
                start = len("".join(self._blocks))
                self._spans.append((start, start + len(text)))
            return text

        @contextlib.contextmanager
        def activate_tracker(self, blocks: list, spans: list):
            self._blocks, self._spans = blocks, spans
            try:
                yield
            finally:
                self._blocks = self._spans = None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which a prompt must keep
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    environment = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(source)


@functools.lru_cache(maxsize=16)
def _uses_generation(source: str) -> bool:
    """Whether the template holds a ``{% generation %}`` block (found in its syntax tree)."""
    import jinja2.nodes as nodes

    tree = _compile(source).environment.parse(source)
    return any(
        isinstance(block.call, nodes.Call)
        and isinstance(block.call.node, nodes.ExtensionAttribute)
        and block.call.node.name == "_generation_support"
        for block in tree.find_all(nodes.CallBlock)
    )


def _token_text(value: Any) -> str | None:
    """A special token of a tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens_of(tokenizer: Any) -> dict[str, str]:
    """The special tokens a tokenizer's ``tokenizer_config.json`` names, as strings
    (``{"bos_token": "<s>", ...}``); none for a tokenizer without a config."""
    config = getattr(tokenizer, "config", None) or {}
    return {
        key: text for key in SPECIAL_TOKENS if (text := _token_text(config.get(key))) is not None
    }


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it reads.

    source: the template's Jinja text.
    special_tokens: ``{"bos_token": "<s>", "eos_token": "</s>", ...}`` handed to
      the template as variables, as ``transformers`` hands them.
    """

    source: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"ChatTemplate needs the template's Jinja text, got {self.source!r}")
        try:
            _compile(self.source)
        except ImportError:
            raise
        except Exception as error:  # jinja2.TemplateSyntaxError
            raise ChatTemplateError(
                f"the chat template does not compile ({type(error).__name__}: {error}); "
                f"fix the template"
            ) from None

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, *, name: str | None = None) -> ChatTemplate:
        """The template of an :class:`dew.data.HFTokenizer`: ``chat_template.jinja``
        beside its ``tokenizer.json``, else ``tokenizer_config.json``'s
        ``chat_template`` (a string, or a list of ``{"name", "template"}`` from which
        ``name`` is taken, ``"default"`` when None), with its special tokens."""
        config = getattr(tokenizer, "config", None) or {}
        path = getattr(tokenizer, "path", None)
        directory = os.path.dirname(path) if path else None
        source = config.get("chat_template")
        jinja_file = os.path.join(directory, "chat_template.jinja") if directory else None
        if jinja_file and os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                source = f.read()
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            wanted = name or "default"
            if wanted not in named:
                raise KeyError(
                    f"the tokenizer has no chat template named {wanted!r}; its templates are "
                    f"{sorted(str(n) for n in named)}"
                )
            source = named[wanted]
        if not isinstance(source, str):
            where = directory or "the tokenizer"
            raise ValueError(
                f"{where} has no chat template (no chat_template in tokenizer_config.json, no "
                f"chat_template.jinja); give one with chat_template='...' (its Jinja text)"
            )
        return cls(source, special_tokens_of(tokenizer))

    @property
    def has_generation(self) -> bool:
        """Whether the template marks assistant text with ``{% generation %}``."""
        return _uses_generation(self.source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        **variables: Any,
    ) -> str:
        """The conversation as text (``apply_chat_template(tokenize=False)``)."""
        return self._render(messages, add_generation_prompt, variables, None)

    def _render(self, messages, add_generation_prompt, variables, spans: list | None) -> str:
        template = _compile(self.source)
        context = {
            **self.special_tokens,
            "tools": None,
            "documents": None,
            **variables,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        blocks: list[str] = []
        tracking = (
            template.environment.activate_tracker(blocks, spans)
            if spans is not None
            else contextlib.nullcontext()
        )
        try:
            with tracking:
                for block in template.generate(**context):
                    blocks.append(block)
        except Exception as error:  # a raise_exception, an undefined name, a type error
            raise ChatTemplateError(
                f"the chat template failed to render ({type(error).__name__}: {error})"
            ) from None
        return "".join(blocks)

    def assistant_spans(
        self, messages: Sequence[Mapping[str, Any]], *, first: int = 0, **variables: Any
    ) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the whole conversation rendered, and the ``(start, end)``
        characters of each assistant turn at or after message ``first`` (earlier
        ones are context: a conversational prompt's few-shot answers).

        With ``{% generation %}`` blocks, the spans are theirs. Otherwise turn ``k``
        spans the text that ``messages[:k + 1]`` rendered adds to ``messages[:k]``
        rendered with the generation prompt: what the model writes after being
        prompted, its end-of-turn token included. A template that renders an
        earlier part of the conversation differently once more turns follow has no
        such spans: an error that says to add ``{% generation %}`` blocks.
        """
        if self.has_generation:
            spans: list[tuple[int, int]] = []
            text = self._render(messages, False, variables, spans)
            start = len(self._render(messages[:first], True, variables, None)) if first else 0
            return text, [span for span in spans if span[0] >= start]
        text = self.render(messages, **variables)
        spans = []
        for k in range(first, len(messages)):
            if messages[k].get("role") != "assistant":
                continue
            before = self.render(messages[:k], add_generation_prompt=True, **variables)
            through = self.render(messages[: k + 1], **variables)
            if not (through.startswith(before) and text.startswith(through)):
                raise ChatTemplateError(
                    f"the chat template renders the conversation differently once later "
                    f"turns follow (message {k}, the assistant's, is not a prefix of the "
                    f"whole), so its assistant text cannot be found by rendering prefixes; "
                    f"use a template that marks it with {{% generation %}} ... "
                    f"{{% endgeneration %}}"
                )
            spans.append((len(before), len(through)))
        return text, spans

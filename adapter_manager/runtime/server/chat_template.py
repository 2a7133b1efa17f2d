"""Chat messages -> prompt text: the checkpoint's Jinja chat template (``chat_template`` in tokenizer_config.json, or
``chat_template.jinja``) rendered in a sandbox as transformers does, else `DEFAULT_CHAT_TEMPLATE`.

The default, for checkpoints without a template (random demo models), is one line per message and an open
assistant turn::

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_TEMPLATE_FILE = "chat_template.jinja"
_CONFIG_FILE = "tokenizer_config.json"


class ChatTemplateError(ValueError):
    """The template could not render these messages (it raised, or uses something the sandbox refuses)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template. ``from_checkpoint`` says whether it came from the model (then the rendered text
    carries the BOS token itself) or is the default (then BOS is added when encoding)."""

    source: str
    from_checkpoint: bool
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            object.__setattr__(self, "_template", env.from_string(self.source))
        except TemplateError as err:
            raise ChatTemplateError(f"chat template does not compile: {err}") from err

    def __reduce__(self) -> tuple:  # pickled by its fields (Ray ships configs to replicas), compiled again on load
        return type(self), (self.source, self.from_checkpoint, self.bos_token, self.eos_token)

    def render(self, messages: list[dict[str, str]]) -> str:
        """Shape: messages = [{"role": ..., "content": ...}, ...]; returns the prompt with the assistant turn open."""
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        except TemplateError as err:
            raise ChatTemplateError(f"chat template failed on these messages: {err}") from err

    @classmethod
    def default(cls) -> ChatTemplate:
        return cls(DEFAULT_CHAT_TEMPLATE, from_checkpoint=False)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate:
        """The checkpoint's own template if it has one, else the default."""
        folder = Path(folder)
        config = {}
        if (folder / _CONFIG_FILE).is_file():
            config = json.loads((folder / _CONFIG_FILE).read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        if not source and (folder / _TEMPLATE_FILE).is_file():
            source = (folder / _TEMPLATE_FILE).read_text()
        if not isinstance(source, str) or not source:
            return cls.default()
        return cls(source, True, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


def _token_text(value: object) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise(message: str) -> None:
    raise TemplateError(message)

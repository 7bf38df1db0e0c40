"""Chat templates: a checkpoint's Jinja template rendered the way transformers'
``apply_chat_template`` renders it (docs: https://huggingface.co/docs/transformers/chat_templating):
a sandboxed, immutable jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception`` and
``strftime_now``; the template sees ``messages``, ``add_generation_prompt`` and the special tokens
(``bos_token``, ``eos_token``, ...) of tokenizer_config.json.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from ..errors import K3Error


def _raise(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=4)
def _compile(template: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def render_chat(template: str | None, messages: list[dict], special_tokens: dict[str, str],
                add_generation_prompt: bool = True) -> str:
    """The prompt text of ``messages`` ([{"role": ..., "content": ...}]); K3Error if the checkpoint
    has no template or it fails to compile or render (its own raise_exception included)."""
    import jinja2
    if not template:
        raise K3Error("chat: this bundle's tokenizer has no chat template (chat_template.jinja or the "
                      "chat_template field of tokenizer_config.json)")
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **special_tokens)
    except jinja2.TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise K3Error(f"chat: the chat template fails to render{where}: {e.message or type(e).__name__}") from None

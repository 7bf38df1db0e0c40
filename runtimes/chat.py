"""Chat templates: a checkpoint's Jinja template rendered the way transformers'
``apply_chat_template`` renders it (docs: https://huggingface.co/docs/transformers/chat_templating):
a sandboxed, immutable jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception`` and
``strftime_now``; the template sees ``messages``, ``add_generation_prompt``, ``tools`` and
``documents`` (None) and the special tokens (``bos_token``, ``eos_token``, ...) of
tokenizer_config.json.

Rendering is bounded: a template runs at most ``RENDER_SECONDS`` and writes at most ``max_chars``
characters (what can fit the context); ``*`` and ``**`` are refused when their result would be
larger than that; any exception a template raises is one K3Error.
"""
from __future__ import annotations

import contextlib
import json
import operator
import signal
import threading
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ..errors import K3Error
from .tokenizer import TextStream


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


RENDER_SECONDS = 10
MAX_OPERAND = 1 << 24   # the largest sequence or integer (in bits) that ``*`` and ``**`` may make


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with ``*`` and ``**`` checked before they run (jinja2's documented
    hook, ``intercepted_binops``), so ``'a' * 10**12`` or ``9 ** 9 ** 9`` is an error, not an
    allocation that no time limit can interrupt."""
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator_name, left, right):
        if operator_name == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OPERAND:
                raise SecurityError(f"the template repeats a sequence of {len(seq)} items {n} times")
            return operator.mul(left, right)
        if isinstance(left, int) and isinstance(right, int) and right > 0 \
                and max(left.bit_length(), 1) * right > MAX_OPERAND:
            raise SecurityError(f"the template raises {left} to the power {right}")
        return operator.pow(left, right)


class _TimedOut(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise _TimedOut in the block after ``seconds`` (SIGALRM; only the main thread can take
    signals, elsewhere the block runs unbounded in time)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _TimedOut

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@lru_cache(maxsize=4)
def _compile(template: str):
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def render_chat(template: str | None, messages: list[dict], special_tokens: dict[str, str],
                add_generation_prompt: bool = True, max_chars: int = MAX_OPERAND) -> str:
    """The prompt text of ``messages`` ([{"role": ..., "content": ...}]); K3Error if the checkpoint
    has no template, or it fails to compile or render (its own raise_exception included, and any
    other exception), runs past RENDER_SECONDS or writes more than ``max_chars`` characters."""
    if not template:
        raise K3Error("chat: this bundle's tokenizer has no chat template (chat_template.jinja or the "
                      "chat_template field of tokenizer_config.json)")
    pieces, size = [], 0
    try:
        with _deadline(RENDER_SECONDS):
            for piece in _compile(template).generate(messages=messages, tools=None, documents=None,
                                                     add_generation_prompt=add_generation_prompt, **special_tokens):
                size += len(piece)
                if size > max_chars:
                    raise K3Error(f"chat: the chat template writes more than {max_chars:,} characters "
                                  "(more than can fit the context)")
                pieces.append(piece)
    except _TimedOut:
        raise K3Error(f"chat: the chat template runs longer than {RENDER_SECONDS} s") from None
    except jinja2.TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise K3Error(f"chat: the chat template fails to render{where}: {e.message or type(e).__name__}") from None
    except K3Error:
        raise
    except Exception as e:   # a template's own errors: 1/0, a recursive macro, messages + 1, ...
        why = str(e).splitlines()[0][:200] if str(e) else ""
        raise K3Error(f"chat: the chat template fails to render: {type(e).__name__}" + (f": {why}" if why else "")) \
            from None
    return "".join(pieces)


def encode_prompt(tokenizer, prompt: str, chat: bool = False, system: str | None = None,
                  max_tokens: int = MAX_OPERAND) -> list[int]:
    """The ids of a plain prompt, or with ``chat`` of one user turn (after ``system``, if given)
    rendered with the checkpoint's chat template, generation prompt included; the rendering bounded
    by the text that can fit ``max_tokens``."""
    if not chat:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.encode(render_chat(tokenizer.chat_template, messages, tokenizer.special_tokens,
                                        max_chars=tokenizer.text_limit(max_tokens)), chat=True)


def generate_text(session, tokenizer, prompt_ids: list[int], *, max_new_tokens: int, sampler=None,
                  stops: tuple[str, ...] = (), write=lambda text: None, continue_sequence: bool = False):
    """Generate from ``prompt_ids`` (Session.generate), stopping at the tokenizer's EOS ids and at
    ``stops``; ``write`` gets the text as it is produced. Returns (text, Generation)."""
    stream = TextStream(tokenizer, stops)

    def on_token(token: int) -> bool:
        text, stopped = stream.feed(token)
        write(text)
        return stopped

    gen = session.generate(prompt_ids, max_new_tokens, sampler, tokenizer.eos_ids, on_token, continue_sequence)
    write(stream.finish())
    return stream.text, gen


def read_turn(stream, tokenizer, max_context: int) -> str:
    """One line of ``stream`` (bytes) as text: read no further than the longest line that can fit
    the context, and decoded as strict UTF-8 (K3Error otherwise). "" at the end of input."""
    limit = tokenizer.text_limit(max_context)
    line = stream.readline(limit + 2)   # the line, its newline, and one byte to tell it is longer
    if len(line.rstrip(b"\r\n")) > limit:
        raise K3Error(f"chat: a line of more than {limit:,} bytes cannot fit the context of {max_context:,} tokens")
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise K3Error(f"chat: the line is not valid UTF-8 text (byte {e.start})") from None


class Conversation:
    """A chat whose state stays on the device between turns. Each turn renders the whole
    conversation; when that text begins with the text the state already holds (the previous prompt
    and the reply as generated), only the rest is encoded and fed through ``extend`` after the
    reply's last id (which generation never feeds); otherwise (a template that rewrites earlier
    turns, a reply cut at a stop string) the whole conversation is prefilled again."""

    def __init__(self, session, tokenizer, system: str | None = None):
        self.session, self.tokenizer = session, tokenizer
        self.messages = [{"role": "system", "content": system}] if system else []
        self.state_text = ""
        self.last_id: int | None = None

    def prompt(self, user: str) -> tuple[str, list[int], bool]:
        """Add the user's turn: (the rendered conversation, the ids to feed, whether they continue
        the current state)."""
        self.messages.append({"role": "user", "content": user})
        text = render_chat(self.tokenizer.chat_template, self.messages, self.tokenizer.special_tokens,
                           max_chars=self.tokenizer.text_limit(self.session.max_context))
        if self.last_id is not None and text.startswith(self.state_text):
            return text, [self.last_id] + self.tokenizer.encode(text[len(self.state_text):], chat=True), True
        return text, self.tokenizer.encode(text, chat=True), False

    def turn(self, user: str, **generate):
        """One exchange: the reply streamed through ``generate['write']``; (reply, Generation)."""
        text, ids, continues = self.prompt(user)
        reply, gen = generate_text(self.session, self.tokenizer, ids, continue_sequence=continues, **generate)
        self.state_text = text + self.tokenizer.decode(gen.ids)
        self.last_id = gen.ids[-1]
        self.messages.append({"role": "assistant", "content": reply})
        return reply, gen

"""Tokenizers from a checkpoint directory, and the byte-level one of the random-weight presets.

- ``tiktoken.model`` (Kimi): one ``base64(token bytes) rank`` line per mergeable token, encoded by
  ``tiktoken``; ids from the number of those tokens up to the vocabulary are special tokens, named
  by ``added_tokens_decoder`` of ``tokenizer_config.json`` (the rest ``<|reserved_token_<id>|>``);
  text is split with Kimi's pattern (``PAT_STR``, from the ``pat_str`` of Kimi's
  tokenization_kimi.py: runs of Han characters apart, then cl100k-style rules). Special-token text
  in the input encodes as the special token, as Kimi's ``TikTokenTokenizer.encode`` does.
- ``tokenizer.json``: the Hugging Face ``tokenizers`` library, encoding as
  ``PreTrainedTokenizerFast`` does (its post-processor's special tokens for a plain prompt, none for
  a rendered chat; decoding keeps special tokens).
- presets: ``write_byte_level_tokenizer`` writes a ``tokenizer.json`` whose ids 0-255 are the bytes and
  256, 257 are ``<|bos|>``, ``<|eos|>`` (ids above decode to nothing), and a plain chat template.

EOS ids come from ``generation_config.json`` and ``config.json`` (``eos_token_id``: an id or a list)
and the ``eos_token`` of ``tokenizer_config.json``. The chat template is ``chat_template.jinja`` or
the ``chat_template`` field of ``tokenizer_config.json``.
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from pathlib import Path

import tiktoken
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from ..errors import K3Error

# Files a checkpoint's tokenizer may consist of; a bundle carries those present (tokenizer/).
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json")
PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
BYTE_SPECIALS = ("<|bos|>", "<|eos|>")
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")


@dataclass
class Tokenizer:
    """Text <-> ids for one checkpoint; ``encode(text, chat=True)`` for a rendered chat template."""
    files: list[str]
    eos_ids: frozenset[int]
    special_tokens: dict[str, str] = field(default_factory=dict)   # bos_token, eos_token, ... for templates
    chat_template: str | None = None
    max_token_bytes: int = 1      # the most UTF-8 bytes one token stands for (its vocabulary's longest)

    def text_limit(self, max_tokens: int) -> int:
        """The most bytes of text that can encode to ``max_tokens`` tokens or fewer: a longer text
        cannot fit, and is refused before the tokenizer spends memory on it."""
        return max_tokens * self.max_token_bytes

    def encode(self, text: str, chat: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


@dataclass
class TiktokenTokenizer(Tokenizer):
    encoding: object = None

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode_bytes(ids).decode("utf-8", errors="replace")


@dataclass
class JsonTokenizer(Tokenizer):
    tokenizer: object = None

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=not chat).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


MAX_TEMPLATE_BYTES = 1 << 20   # a chat template (released ones are a few KB), checked before it is read


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise K3Error(f"tokenizer: {path} is not valid JSON ({e})") from None
    except RecursionError:
        raise K3Error(f"tokenizer: {path} is nested too deeply to be a tokenizer file") from None
    if not isinstance(data, dict):
        raise K3Error(f"tokenizer: {path} is not a JSON object")
    return data


def _token_text(value) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict ({"content": ...})."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(directory: Path, config: dict) -> str | None:
    """``chat_template.jinja``, else the ``chat_template`` field of tokenizer_config.json: a string,
    or named templates ``[{"name": "default", "template": ...}, ...]``; K3Error for anything else,
    for a file that is not UTF-8 and for a template over MAX_TEMPLATE_BYTES."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        if jinja.stat().st_size > MAX_TEMPLATE_BYTES:
            raise K3Error(f"tokenizer: {jinja} is larger than {MAX_TEMPLATE_BYTES:,} bytes (not a chat template)")
        try:
            return jinja.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise K3Error(f"tokenizer: {jinja} is not UTF-8 text (byte {e.start})") from None
    template = config.get("chat_template")
    where = "tokenizer: tokenizer_config.json: chat_template"
    if isinstance(template, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in template):
            raise K3Error(f"{where} is a list whose items are not all {{\"name\": string, \"template\": string}}")
        template = {t["name"]: t["template"] for t in template}.get("default")
    if template is not None and not isinstance(template, str):
        raise K3Error(f"{where} is a JSON {type(template).__name__}, expected a string or a list of named templates")
    if template is not None and len(template.encode()) > MAX_TEMPLATE_BYTES:
        raise K3Error(f"{where} is larger than {MAX_TEMPLATE_BYTES:,} bytes (not a chat template)")
    return template


def _ids(value, where: str) -> set[int]:
    """``eos_token_id``: an integer id or a list of them (null: none); K3Error naming ``where``."""
    if value is None:
        return set()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
        raise K3Error(f"tokenizer: {where}: eos_token_id must be an integer id or a list of them, got {value!r:.80}")
    return set(ids)


def _added_tokens(config: dict) -> dict[int, str]:
    """``added_tokens_decoder`` of tokenizer_config.json: {"<id>": "<text>" or {"content": "<text>"}}."""
    decoder = config.get("added_tokens_decoder", {})
    where = "tokenizer: tokenizer_config.json: added_tokens_decoder"
    if not isinstance(decoder, dict):
        raise K3Error(f"{where} must be an object of token id -> token")
    out = {}
    for key, value in decoder.items():
        if not (key.isascii() and key.isdecimal()) or not isinstance(text := _token_text(value), str):
            raise K3Error(f"{where}: entry {key!r:.40} must map a decimal id to a string or {{\"content\": string}}")
        out[int(key)] = text
    return out


def _read_ranks(path: Path) -> dict[bytes, int]:
    """The ``base64(token) rank`` lines of a tiktoken BPE file. (Read here, not by
    ``tiktoken.load.load_tiktoken_bpe``, which caches files by path in a temporary directory and
    would return the old contents of a file that changed.)"""
    ranks = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise K3Error(f"tokenizer: {path} line {n} is not a base64 token and a rank: {line[:60]!r}") from None
    return ranks


def _tiktoken(path: Path, config: dict, vocab_size: int):
    ranks = _read_ranks(path)
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) > vocab_size:
        raise K3Error(f"tokenizer: the ranks in {path} are not 0..{len(ranks) - 1} within vocab_size {vocab_size}")
    named = _added_tokens(config)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), vocab_size)}
    try:
        return tiktoken.Encoding(name=path.name, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    except ValueError as e:
        raise K3Error(f"tokenizer: {path}: {e}") from None


def _single_token(encoding, text: str) -> int | None:
    try:
        return encoding.encode_single_token(text)
    except KeyError:
        return None


def _check_ids(path: Path, hf: HFTokenizer, vocab_size: int) -> None:
    """Every id of tokenizer.json below ``vocab_size``, each added token at the id the file gives
    it (tokenizers silently renumbers an added token whose id is not the next free one)."""
    added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    for token in added:
        if not (isinstance(token, dict) and isinstance(token.get("id"), int) and isinstance(token.get("content"), str)):
            raise K3Error(f"tokenizer: {path}: added_tokens entries must be objects with an integer id and a string content")
        if not 0 <= token["id"] < vocab_size:
            raise K3Error(f"tokenizer: {path}: added token {token['content']!r:.40} has id {token['id']}, outside "
                          f"the model's vocab_size {vocab_size}")
        if hf.token_to_id(token["content"]) != token["id"]:
            raise K3Error(f"tokenizer: {path}: added token {token['content']!r:.40} is id {token['id']} in the file, "
                          f"but the tokenizer gives it id {hf.token_to_id(token['content'])}")
    top = max(hf.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise K3Error(f"tokenizer: {path}: token id {top} is outside the model's vocab_size {vocab_size}")


def load_tokenizer(directory: Path, vocab_size: int, model_config: Path | None = None) -> Tokenizer:
    """The tokenizer in ``directory`` (``tiktoken.model`` first, else ``tokenizer.json``), with the
    EOS ids of its configs and of ``model_config`` (the checkpoint's config.json)."""
    directory = Path(directory)
    config = _read_json(directory / "tokenizer_config.json")
    files = sorted(f.name for f in directory.iterdir() if f.name in TOKENIZER_FILES) if directory.is_dir() else []
    specials = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if isinstance(t := _token_text(config.get(k)), str)}
    common = dict(files=files, eos_ids=frozenset(), special_tokens=specials,
                  chat_template=_chat_template(directory, config))
    if (directory / "tiktoken.model").is_file():
        encoding = _tiktoken(directory / "tiktoken.model", config, vocab_size)
        longest = max(map(len, [*encoding.token_byte_values(), *(t.encode() for t in encoding.special_tokens_set)]))
        tok = TiktokenTokenizer(**common, max_token_bytes=longest, encoding=encoding)
        token_id = lambda text: _single_token(tok.encoding, text)  # noqa: E731
    elif (directory / "tokenizer.json").is_file():
        try:
            hf = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise K3Error(f"tokenizer: {directory / 'tokenizer.json'} does not load: {e}") from None
        _check_ids(directory / "tokenizer.json", hf, vocab_size)
        longest = max(len(t.encode()) for t in hf.get_vocab(with_added_tokens=True))
        tok = JsonTokenizer(**common, max_token_bytes=longest, tokenizer=hf)
        token_id = hf.token_to_id
    else:
        raise K3Error(f"tokenizer: no tiktoken.model or tokenizer.json in {directory}")
    eos = _ids(_read_json(directory / "generation_config.json").get("eos_token_id"), "generation_config.json")
    if model_config is not None:
        eos |= _ids(_read_json(model_config).get("eos_token_id"), model_config.name)
    if "eos_token" in specials and token_id(specials["eos_token"]) is not None:
        eos.add(token_id(specials["eos_token"]))
    tok.eos_ids = frozenset(i for i in eos if 0 <= i < vocab_size)
    return tok


def _byte_chars() -> list[str]:
    """The printable stand-in of each byte in byte-level BPE vocabularies (GPT-2's table: printable
    Latin-1 bytes are themselves, the others are shifted to U+0100 onwards, in byte order)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def write_byte_level_tokenizer(directory: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json of a byte-level tokenizer for a random-weight preset:
    ids 0-255 the bytes, 256 ``<|bos|>``, 257 ``<|eos|>`` (the EOS); no merges; a plain chat
    template (``role: content<|eos|>`` per message)."""
    if vocab_size < 256 + len(BYTE_SPECIALS):
        raise K3Error(f"tokenizer: vocab_size {vocab_size} is too small for a byte-level tokenizer")
    hf = HFTokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True) for t in BYTE_SPECIALS])
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BYTE_SPECIALS[0], "eos_token": BYTE_SPECIALS[1], "chat_template": BYTE_CHAT_TEMPLATE}, indent=2))


class TextStream:
    """Generated ids -> text to print as it is produced: holds back an incomplete UTF-8 character
    (decoded as U+FFFD until its last byte arrives) and any tail that may begin a stop string, and
    ends the text before the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.text, self.shown = "", 0

    def feed(self, token: int) -> tuple[str, bool]:
        """(new text to show, whether a stop string was reached)."""
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        cut = min((i for s in self.stops if (i := self.text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return self._show(cut), True
        end = len(self.text.rstrip("\ufffd"))
        held = max((n for s in self.stops for n in range(1, len(s)) if self.text[:end].endswith(s[:n])), default=0)
        return self._show(end - held), False

    def finish(self) -> str:
        """The rest of the text (what was held back) once generation has ended."""
        return self._show(len(self.text))

    def _show(self, upto: int) -> str:
        new = self.text[self.shown:max(upto, self.shown)]
        self.shown = max(upto, self.shown)
        return new


def bundle_tokenizer(bundle) -> Tokenizer:
    """The tokenizer a bundle carries (tokenizer/, written by artifacts/build.carry_tokenizer)."""
    directory = bundle.root / "tokenizer"
    if not directory.is_dir():
        raise K3Error(f"run: {bundle.root} carries no tokenizer (its checkpoint has no tiktoken.model or "
                      "tokenizer.json); give the prompt as --prompt-ids")
    return load_tokenizer(directory, bundle.manifest.config["vocab_size"], bundle.checkpoint_dir / "config.json")

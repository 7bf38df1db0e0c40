"""Small tokenizer directories for the text tests, written from scratch (no downloads): a Kimi-style
tiktoken.model + tokenizer_config.json + chat template, and a byte-level BPE tokenizer.json trained
with the tokenizers library. Vocabularies fit k3-tiny (vocab_size 512)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

VOCAB = 512
# Merges chosen so that the ids show where Kimi's split pattern cuts: b"\xbdw" would merge across
# "好" | "world" and b"34", b"345" across "123" | "45" if those were one piece.
MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"\xbdw", b"34", b"345",
          b"hi", b"\n\n"]
RANKS = {bytes([b]): b for b in range(256)} | {m: 256 + i for i, m in enumerate(MERGES)}
N_BASE = len(RANKS)
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
SPECIAL_IDS = {t: N_BASE + i for i, t in enumerate(SPECIALS)}
# A Kimi-style template (the shape of Kimi's: role header, <|im_middle|>, content, <|im_end|>), with
# the features transformers' renderer supports: loop controls, tojson, raise_exception.
KIMI_TEMPLATE = """\
{%- for message in messages -%}
  {%- if message['role'] not in ['system', 'user', 'assistant'] -%}
    {{ raise_exception('unknown role ' ~ message['role']) }}
  {%- endif -%}
  {%- if message['role'] == 'system' and not loop.first -%}{% continue %}{%- endif -%}
  <|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""


def write_kimi_tokenizer(directory: Path, template: str = KIMI_TEMPLATE) -> Path:
    """tiktoken.model (base64 token, rank per line), tokenizer_config.json (added_tokens_decoder,
    bos/eos), chat_template.jinja, generation_config.json (EOS <|im_end|>)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in RANKS.items()))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in SPECIAL_IDS.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]"}))
    (directory / "chat_template.jinja").write_text(template)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": SPECIAL_IDS["<|im_end|>"]}))
    return directory


def write_bpe_tokenizer_json(directory: Path) -> Path:
    """A byte-level BPE tokenizer.json (vocab 400) trained on a few sentences, with <s>/</s> special
    tokens and a post-processor that puts <s> before a sequence, plus tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["hello world, the quick brown fox jumps over the lazy dog", "naïve café déjà vu 你好世界",
              "    indented code(x) = y + 1\n\ttabs", "numbers 12345 and 67890"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return directory

"""Tokenizers, chat templates, sampling and text streaming, without a compiled bundle: against
hand-derived ids and probabilities, and against transformers (PreTrainedTokenizerFast,
apply_chat_template) on the same files."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from text_fixtures import (KIMI_TEMPLATE, N_BASE, RANKS, SPECIAL_IDS, VOCAB, write_bpe_tokenizer_json,
                           write_kimi_tokenizer)

from k3c.errors import K3Error
from k3c.runtimes.chat import render_chat
from k3c.runtimes.sampling import Sampler
from k3c.runtimes.tokenizer import (TextStream, bundle_tokenizer, load_tokenizer,
                                    write_byte_level_tokenizer)

TEXTS = ["hello world", "héllo wörld, naïve café", "你好世界 and 日本語", "emoji 🙂👍🏽 mixed",
         "  leading and trailing  ", "tabs\tand\nnew\r\nlines\n\n\n", "", " ", "12345 67.89",
         "it's we'LL they'd", "\u00a0non-breaking\u2003spaces"]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return load_tokenizer(write_kimi_tokenizer(tmp_path_factory.mktemp("kimi")), VOCAB)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return write_bpe_tokenizer_json(tmp_path_factory.mktemp("bpe"))


def b(text: str) -> list[int]:
    """The single-byte ids of ``text`` (id = byte value in the fixture)."""
    return list(text.encode())


def test_kimi_split_pattern_cuts_han_and_numbers(kimi):
    """Ids derived by hand from the fixture's merges: Han runs and 3-digit groups are pieces of
    their own, so the merges b"\\xbdw" and b"34"/b"345" never apply; within a piece BPE merges."""
    assert kimi.encode("hello world") == [RANKS[b"hello"], RANKS[b" world"]]
    assert kimi.encode("你好world") == b("你好") + [ord("w"), RANKS[b"or"], RANKS[b"ld"]]
    assert kimi.encode("12345") == b("12345")
    assert kimi.encode("x 345") == [ord("x"), ord(" "), RANKS[b"345"]]


def test_kimi_special_tokens(kimi):
    """Special-token text encodes as the special token (as Kimi's encode, allowed_special="all");
    ids past the named ones are reserved tokens; EOS from generation_config.json and eos_token."""
    ids = kimi.encode("<|im_user|>hi<|im_end|>")
    assert ids == [SPECIAL_IDS["<|im_user|>"], RANKS[b"hi"], SPECIAL_IDS["<|im_end|>"]]
    assert kimi.decode(ids) == "<|im_user|>hi<|im_end|>"
    assert kimi.decode([VOCAB - 1]) == f"<|reserved_token_{VOCAB - 1}|>"
    assert kimi.eos_ids == {SPECIAL_IDS["<|im_end|>"], SPECIAL_IDS["[EOS]"]}
    assert kimi.special_tokens == {"bos_token": "[BOS]", "eos_token": "[EOS]"}
    assert N_BASE + len(SPECIAL_IDS) < VOCAB


@pytest.mark.parametrize("text", TEXTS)
def test_kimi_round_trip(kimi, text):
    ids = kimi.encode(text)
    assert all(0 <= i < VOCAB for i in ids)
    assert kimi.decode(ids) == text


def test_tokenizer_json_matches_transformers(bpe_dir):
    """Plain prompts get the post-processor's <s>, rendered chats none (add_special_tokens=False),
    as PreTrainedTokenizerFast on the same file; decoding keeps special tokens."""
    from transformers import PreTrainedTokenizerFast
    ours = load_tokenizer(bpe_dir, VOCAB)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    for text in TEXTS + ["<s>special</s> in text"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, chat=True) == ref.encode(text, add_special_tokens=False), text
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False), text
        assert ours.decode(ours.encode(text, chat=True)) == text
    assert ours.eos_ids == {ref.eos_token_id}


def test_byte_level_preset_tokenizer(tmp_path):
    """Ids 0-255 are the bytes themselves, 256/257 BOS/EOS; transformers reads the file alike."""
    from transformers import PreTrainedTokenizerFast
    write_byte_level_tokenizer(tmp_path, VOCAB)
    tok = load_tokenizer(tmp_path, VOCAB)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text) == b(text) == ref.encode(text)
        assert tok.decode(b(text)) == text
    assert tok.encode("a<|eos|>") == [97, 257] and tok.eos_ids == {257}
    assert tok.decode([104, 300, 105]) == "hi"  # ids without a token decode to nothing
    messages = [{"role": "user", "content": "hé"}, {"role": "assistant", "content": "ok"}]
    rendered = render_chat(tok.chat_template, messages, tok.special_tokens)
    assert rendered == "user: hé<|eos|>\nassistant: ok<|eos|>\nassistant: "
    assert rendered == PreTrainedTokenizerFast.from_pretrained(tmp_path).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(bpe_dir, generation_prompt):
    from transformers import PreTrainedTokenizerFast
    ref = PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    template = "{{ bos_token }}" + KIMI_TEMPLATE + "{% for m in messages %}{{ m | tojson }}{% endfor %}"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 你好\n  x"},
                {"role": "assistant", "content": "hi"}, {"role": "system", "content": "skipped"},
                {"role": "user", "content": "again"}]
    ours = render_chat(template, messages, {"bos_token": "<s>", "eos_token": "</s>"}, generation_prompt)
    assert ours == ref.apply_chat_template(messages, chat_template=template, tokenize=False,
                                           add_generation_prompt=generation_prompt)
    assert ours.startswith("<s><|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>")
    assert ("<|im_end|><|im_assistant|>assistant<|im_middle|>{" in ours) == generation_prompt


def test_chat_template_errors():
    with pytest.raises(K3Error, match=r"^chat: the chat template fails to render: unknown role tool$"):
        render_chat(KIMI_TEMPLATE, [{"role": "tool", "content": "x"}], {})
    with pytest.raises(K3Error, match="fails to render.*line 1"):
        render_chat("{% if %}", [], {})
    with pytest.raises(K3Error, match="has no chat template"):
        render_chat(None, [], {})


def test_chat_template_from_tokenizer_config(tmp_path):
    """Without chat_template.jinja, the chat_template field (a string, or named templates)."""
    write_kimi_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for field in ("{{ 'A' }}", [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ 'A' }}"}]):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": field}))
        assert load_tokenizer(tmp_path, VOCAB).chat_template == "{{ 'A' }}"


def test_bad_tokenizer_files(tmp_path):
    kimi = write_kimi_tokenizer(tmp_path / "kimi")
    (kimi / "tiktoken.model").write_text("not base64!! 0\n")
    with pytest.raises(K3Error, match="tiktoken.model line 1 is not a base64 token and a rank"):
        load_tokenizer(kimi, VOCAB)
    (kimi / "tiktoken.model").write_text("YQ== 5\n")
    with pytest.raises(K3Error, match="ranks .* are not 0..0"):
        load_tokenizer(kimi, VOCAB)
    bpe = write_bpe_tokenizer_json(tmp_path / "bpe")
    (bpe / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(K3Error, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(bpe, VOCAB)
    (bpe / "tokenizer_config.json").unlink()
    (bpe / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(K3Error, match="tokenizer.json does not load"):
        load_tokenizer(bpe, VOCAB)
    with pytest.raises(K3Error, match="no tiktoken.model or tokenizer.json"):
        load_tokenizer(tmp_path / "empty", VOCAB)
    with pytest.raises(K3Error, match="carries no tokenizer.*--prompt-ids"):
        bundle_tokenizer(SimpleNamespace(root=tmp_path / "empty"))


def test_sampler_distribution_hand_derived():
    logits = np.array([2.0, 1.0, 0.0, -1.0])
    e = np.exp(logits)
    assert Sampler()(logits) == 0  # greedy
    np.testing.assert_allclose(Sampler(1.0).probabilities(logits), e / e.sum(), rtol=1e-12)
    np.testing.assert_allclose(Sampler(2.0).probabilities(logits), np.exp(logits / 2) / np.exp(logits / 2).sum(),
                               rtol=1e-12)
    np.testing.assert_allclose(Sampler(1.0, top_k=2).probabilities(logits), [e[0] / e[:2].sum(), e[1] / e[:2].sum(),
                                                                              0, 0], rtol=1e-12)
    # softmax = [0.644, 0.237, 0.087, 0.032]: 0.644 < 0.7, so the nucleus for 0.7 is the first two
    np.testing.assert_allclose(Sampler(1.0, top_p=0.7).probabilities(logits),
                               [e[0] / e[:2].sum(), e[1] / e[:2].sum(), 0, 0], rtol=1e-12)
    np.testing.assert_allclose(Sampler(1.0, top_p=0.5).probabilities(logits), [1, 0, 0, 0])


def test_sampler_reproducible_and_follows_the_distribution():
    logits = np.array([1.0, 0.5, 0.0, -3.0, 2.0])
    draws = [Sampler(0.8, seed=1)(logits) for _ in range(3)]
    assert len(set(draws)) == 1
    s = Sampler(0.8, seed=7)
    a = [s(logits) for _ in range(20000)]
    s = Sampler(0.8, seed=7)
    assert a == [s(logits) for _ in range(20000)]
    p = np.exp(logits / 0.8) / np.exp(logits / 0.8).sum()
    freq = np.bincount(a, minlength=logits.size) / len(a)
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(p * (1 - p) / len(a)).max())


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.5)])
def test_sampler_rejects_bad_values(bad):
    with pytest.raises(K3Error):
        Sampler(**bad)


def test_text_stream_utf8_and_stop_strings(tmp_path):
    write_byte_level_tokenizer(tmp_path, VOCAB)
    tok = load_tokenizer(tmp_path, VOCAB)
    stream = TextStream(tok)
    assert [stream.feed(i) for i in b("é🙂")] == [("", False), ("é", False), ("", False), ("", False), ("", False),
                                                 ("🙂", False)]
    stream = TextStream(tok, stops=("lo w", "xyz"))
    shown = [stream.feed(i) for i in b("hello world")[:6]]
    assert "".join(s for s, _ in shown) == "hel" and not any(stop for _, stop in shown)  # "lo " may start "lo w"
    assert stream.feed(ord("w")) == ("", True) and stream.text == "hel"
    stream = TextStream(tok, stops=("xyz",))
    assert "".join(stream.feed(i)[0] for i in b("abcx")) == "abc"
    assert stream.finish() == "x"

"""Text in, text out on compiled k3-tiny bundles: a checkpoint carrying a Kimi-style tiktoken.model,
tokenizer_config.json and chat template, its context raised to 4096 (NoPE: no weight depends on it)
and compiled with --max-prompt 300, so that a long prompt runs in pieces through the extend entry
point, each piece two of the CPU KDA lowering's 256-token blocks (the second padded) started from
the state the piece before left; and the preset bundle of conftest.py with its byte-level tokenizer.
Checked against the eager model."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from text_fixtures import SPECIAL_IDS, write_kimi_tokenizer

from conftest import eager_greedy  # tests/ is on sys.path
from k3c.errors import K3Error
from k3c.model.checkpoint import load_checkpoint
from k3c.runtimes.chat import Conversation
from k3c.runtimes.session import Session
from k3c.runtimes.tokenizer import bundle_tokenizer

K3C = Path(sys.executable).with_name("k3c")
TOL = 1e-4          # fp32 max abs logit error on the CPU, as tests/test_e2e.py
MAX_PROMPT = 300
CONTEXT = 4096

pytestmark = pytest.mark.slow  # k3-tiny bundles


def k3c(*args, cache: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(K3C), *map(str, args)], capture_output=True, text=True, timeout=900, input=stdin,
                          env={**os.environ, "K3C_CACHE": str(cache)})


@pytest.fixture(scope="session")
def kimi_checkpoint(tmp_path_factory) -> Path:
    """k3-tiny seed-0 weights, context CONTEXT, with the Kimi-style tokenizer files beside them."""
    from k3c.model import K3Config, K3Model
    from k3c.model.convert import save_checkpoint
    from k3c.model.init import init_weights
    ck = tmp_path_factory.mktemp("kimi-ck") / "checkpoint"
    save_checkpoint(init_weights(K3Model(K3Config.preset("k3-tiny")), 0), ck)
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return write_kimi_tokenizer(ck)


@pytest.fixture(scope="session")
def kimi_bundle(tmp_path_factory, k3c_cache, kimi_checkpoint):
    from k3c.interface.build import build_bundle
    from k3c.compiler.targets import parse_target
    with pytest.MonkeyPatch.context() as env:
        env.setenv("K3C_CACHE", str(k3c_cache))
        return build_bundle(tmp_path_factory.mktemp("bundles") / "kimi16", parse_target("cpu"),
                            checkpoint=kimi_checkpoint, max_prompt=MAX_PROMPT)


@pytest.fixture(scope="session")
def eager(kimi_bundle):
    return load_checkpoint(kimi_bundle.checkpoint_dir, dtype=torch.float32)


def test_bundle_carries_the_tokenizer(kimi_bundle):
    files = kimi_bundle.manifest.files
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert f"tokenizer/{name}" in files
    assert "extend" in kimi_bundle.manifest.entry_points


def test_prompt_10x_max_prompt_matches_one_eager_prefill(kimi_bundle, eager):
    """3000 tokens in pieces of 300 (prefill, then extend 9 times from the state): every logit within
    TOL of one eager prefill of the whole prompt, and the same greedy continuation."""
    prompt = torch.randint(0, 512, (10 * MAX_PROMPT,), generator=torch.Generator().manual_seed(11))
    session = Session(kimi_bundle)
    logits, hidden = session.prefill(prompt.numpy(), hidden=True)
    assert hidden is None and session.position == prompt.numel()
    with torch.no_grad():
        ref = eager.prefill(prompt[None])[0][0].numpy()
    np.testing.assert_allclose(logits, ref, rtol=0, atol=TOL)
    gen = session.generate(prompt.numpy(), 8)
    assert gen.ids == eager_greedy(eager, prompt.tolist(), 8) and gen.finish_reason == "length"


def test_chat_turns_extend_the_state(kimi_bundle, eager):
    """Two chat turns: the second feeds only its own tokens (after the first reply's last id), and
    both replies are the eager model's greedy continuations of the whole conversation so far."""
    tok = bundle_tokenizer(kimi_bundle)
    chat = Conversation(Session(kimi_bundle), tok, system="be brief")
    first = tok.encode("<|im_system|>system<|im_middle|>be brief<|im_end|><|im_user|>user<|im_middle|>hello world"
                       "<|im_end|><|im_assistant|>assistant<|im_middle|>")
    _, gen1 = chat.turn("hello world", max_new_tokens=6)
    assert gen1.n_prompt == len(first) and gen1.ids == eager_greedy(eager, first, 6)
    text, ids, continues = chat.prompt("and 你好")
    chat.messages.pop()
    assert continues and ids[0] == gen1.ids[-1] and len(ids) < len(tok.encode(text, chat=True))
    _, gen2 = chat.turn("and 你好", max_new_tokens=6)
    assert gen2.n_prompt == len(ids)
    assert gen2.ids == eager_greedy(eager, first + gen1.ids + ids[1:], 6)


def test_run_chat_renders_the_template_and_sampling_repeats(kimi_bundle, k3c_cache):
    args = ("run", kimi_bundle.root, "--chat", "--system", "be brief", "--prompt", "hi", "-n", 12, "--json")
    r = k3c(*args, "--seed", 1, "--temperature", 0.8, cache=k3c_cache)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rendered = ("<|im_system|>system<|im_middle|>be brief<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>")  # KIMI_TEMPLATE by hand
    assert out["prompt_ids"] == bundle_tokenizer(kimi_bundle).encode(rendered)
    assert out["prompt_ids"][:2] == [SPECIAL_IDS["<|im_system|>"], ord("s")]
    again = json.loads(k3c(*args, "--seed", 1, "--temperature", 0.8, cache=k3c_cache).stdout)
    other = json.loads(k3c(*args, "--seed", 2, "--temperature", 0.8, cache=k3c_cache).stdout)
    assert again["ids"] == out["ids"] and again["text"] == out["text"]
    assert other["ids"] != out["ids"]
    assert out["finish_reason"] in ("length", "eos") and len(out["ids"]) <= 12
    assert "prefill" in r.stderr and "tok/s" in r.stderr


def test_chat_command_keeps_state_between_piped_turns(kimi_bundle, k3c_cache):
    r = k3c("chat", kimi_bundle.root, "-n", 4, cache=k3c_cache, stdin="hello\nworld\n")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("prefill ")]
    assert len(lines) == 2 and len(r.stdout.splitlines()) == 2
    chat = Conversation(Session(kimi_bundle), bundle_tokenizer(kimi_bundle))
    chat.turn("hello", max_new_tokens=4)
    _, ids, continues = chat.prompt("world")
    assert continues and lines[1].startswith(f"prefill {len(ids)} tokens")


def test_bad_input_one_line_errors(kimi_bundle, kimi_checkpoint, k3c_cache, tmp_path):
    r = k3c("run", kimi_bundle.root, "--prompt", "a" * (CONTEXT + 1), cache=k3c_cache)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"error: run: the prompt has {CONTEXT + 1} tokens; the context holds {CONTEXT}")
    bad = tmp_path / "b"
    shutil.copytree(kimi_bundle.root, bad)
    (bad / "tokenizer" / "tiktoken.model").write_text("garbage\n")
    r = k3c("run", bad, "--prompt", "hi", cache=k3c_cache)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "tokenizer/tiktoken.model" in r.stderr and "sha256" in r.stderr
    ck = tmp_path / "ck"
    shutil.copytree(kimi_checkpoint, ck)
    (ck / "tiktoken.model").write_text("garbage\n")
    r = k3c("compile", "--checkpoint", ck, "-o", tmp_path / "never", cache=k3c_cache)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        f"error: tokenizer: {ck / 'tiktoken.model'} line 1 is not a base64 token")
    assert not (tmp_path / "never").exists()


def test_context_limit_stops_cleanly(kimi_bundle):
    """-n past the context: generation stops when prompt and generated ids fill the context."""
    session = Session(kimi_bundle)
    prompt = [i % 500 for i in range(CONTEXT - 6)]
    gen = session.generate(prompt, 100)
    assert gen.finish_reason == "context" and len(prompt) + len(gen.ids) == CONTEXT
    session.decode(gen.ids[-1])  # the last token of the context fits
    with pytest.raises(K3Error, match=rf"^run: the context is full: it holds {CONTEXT} tokens"):
        session.decode(0)
    with pytest.raises(K3Error, match=rf"^run: 2 more tokens do not fit: the context holds {CONTEXT} tokens, "
                                      rf"{CONTEXT} used, 0 free"):
        session.extend([1, 2])


def test_preset_bundle_prints_text(tiny_bundle, k3c_cache):
    """`k3c run BUNDLE --prompt hello -n 8` on a preset: its byte-level tokenizer, the eager model's
    greedy ids decoded as text (the bytes themselves), and the throughput line."""
    r = k3c("run", tiny_bundle.root, "--prompt", "hello", "-n", 8, "--json", cache=k3c_cache)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    model = load_checkpoint(tiny_bundle.checkpoint_dir, dtype=torch.float32)
    expected = eager_greedy(model, list(b"hello"), 8)
    eos = expected.index(257) + 1 if 257 in expected else 8
    assert out["prompt_ids"] == list(b"hello") and out["ids"] == expected[:eos]
    text = bytes(i for i in out["ids"] if i < 256).decode("utf-8", errors="replace")
    assert out["text"] == text
    r = k3c("run", tiny_bundle.root, "--prompt", "hello", "-n", 8, cache=k3c_cache)
    assert r.returncode == 0 and r.stdout == text + "\n"
    assert r.stderr.startswith("prefill 5 tokens: ") and "decode" in r.stderr and "tok/s" in r.stderr


def test_stop_string_cuts_the_reply_and_the_next_turn_starts_over(kimi_bundle, eager):
    """A stop string that the greedy reply contains: the text ends before it (finish_reason stop,
    the streamed pieces add up to it); the conversation text no longer extends the state's, so the
    next turn is prefilled whole."""
    tok = bundle_tokenizer(kimi_bundle)
    prompt = tok.encode("<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|>")
    full = tok.decode(eager_greedy(eager, prompt, 12))
    stop = full[3:5]
    chat = Conversation(Session(kimi_bundle), tok)
    pieces = []
    reply, gen = chat.turn("hello", max_new_tokens=12, stops=(stop,), write=pieces.append)
    assert gen.finish_reason == "stop" and reply == "".join(pieces) == full[:full.index(stop)]
    text, ids, continues = chat.prompt("again")
    assert not continues and ids == tok.encode(text, chat=True)

"""``k3c serve`` on loopback, driven by the ``openai`` client: answers in OpenAI's shapes, streamed
and not; concurrent requests, decoded together over the bundle's sequence pool, each get what they
get alone (and, from a bundle without a pool, decoded in turn); a client that goes away frees its
slot; bad requests get their status and an error object and the server keeps serving."""
from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import numpy as np
import pytest
from openai import OpenAI

from k3c.runtimes.session import Session
from k3c.runtimes.tokenizer import bundle_tokenizer

pytestmark = pytest.mark.slow   # the suite's k3-tiny bundles
KEY = "test-key"
EOS = 257      # the byte-level tokenizer's <|eos|> (runtimes/tokenizer.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bundle, *options):
    """``k3c serve`` as a user starts it, on a free loopback port; (process, base URL) once /health answers 200."""
    port = free_port()
    k3c = Path(sys.executable).with_name("k3c")    # the console script beside this interpreter
    proc = subprocess.Popen([str(k3c), "serve", str(bundle.root), "--port", str(port), *options],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"k3c serve exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx2.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx2.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("k3c serve did not become healthy in 120 s")


@pytest.fixture(scope="module")
def server(tiny_pool_bundle):
    proc, url = start_server(tiny_pool_bundle, "--api-key", KEY, "--model", "k3-tiny")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


def alone_in(bundle):
    """Greedy ids of a prompt run alone in this process (Session.generate), as text."""
    session, tokenizer = Session(bundle), bundle_tokenizer(bundle)

    def run(prompt_ids: list[int], n: int) -> str:
        ids = session.generate(prompt_ids, n, stop_ids=tokenizer.eos_ids).ids
        return tokenizer.decode([i for i in ids if i not in tokenizer.eos_ids])
    return run


@pytest.fixture(scope="module")
def alone(tiny_pool_bundle):
    return alone_in(tiny_pool_bundle)


def prompt(seed: int, length: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 500, length)]


def test_models_health_and_chat(client, server):
    assert [m.id for m in client.models.list().data] == ["k3-tiny"]
    assert httpx2.get(f"{server}/health").json() == {"status": "ok"}
    r = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert r.usage.completion_tokens == len(choice.logprobs.content) <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    for entry in choice.logprobs.content:   # greedy: the chosen token is the most likely
        assert len(entry.top_logprobs) == 2 and entry.logprob == entry.top_logprobs[0].logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_chat_streamed_equals_whole(client):
    ask = dict(model="k3-tiny", messages=[{"role": "user", "content": "the same question"}], max_tokens=12,
               temperature=0)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_equals_the_session_alone(client, alone):
    ids = prompt(1, 40)
    r = client.completions.create(model="k3-tiny", prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == alone(ids, 10)
    assert r.usage.prompt_tokens == 40


def test_concurrent_streams_each_equal_the_request_alone(client, alone, server):
    """8 streams at once (as many as the pool has slots, decoded 4 at a time): greedy and seeded
    sampling, prompts of 5 to 1,500 tokens (two prefill pieces at the bundle's 1,024), 4 to 24
    tokens each. Each gives the text it gives alone (greedy: also what the session alone generates
    through its batch-1 decode), and its log-probabilities within validate's CPU tolerance (a step
    of 4 runs the kernels compiled for 4 rows, whose sums round otherwise)."""
    asks = [dict(prompt=prompt(10 + i, length), max_tokens=4 + 3 * i, logprobs=1,
                 **({"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i}))
            for i, length in enumerate((5, 1500, 30, 200, 64, 1100, 9, 700))]

    def stream(ask):
        text, logprobs = "", []
        for chunk in client.completions.create(model="k3-tiny", stream=True, **ask):
            text += chunk.choices[0].text
            logprobs += chunk.choices[0].logprobs.token_logprobs
        return text, logprobs

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(stream, asks))
    for ask, (text, logprobs) in zip(asks, together):
        r = client.completions.create(model="k3-tiny", **ask)
        assert text == r.choices[0].text
        np.testing.assert_allclose(logprobs, r.choices[0].logprobs.token_logprobs, rtol=0, atol=1e-4)
        if ask["temperature"] == 0:
            assert text == alone(ask["prompt"], ask["max_tokens"])
    assert metric(server, 'k3c_decode_batch_size_bucket{le="2.0"}') < metric(server, "k3c_decode_batch_size_count")


def test_a_bundle_without_a_pool_serves_its_sequences_in_turn(tiny_bundle):
    proc, url = start_server(tiny_bundle)
    try:
        c = OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=300)
        asks = [(prompt(20 + i, length), 3 + 2 * i) for i, length in enumerate((7, 300, 40))]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(lambda a: c.completions.create(model="m", prompt=a[0], max_tokens=a[1],
                                                                 temperature=0).choices[0].text, asks))
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    run = alone_in(tiny_bundle)
    assert texts == [run(ids, n) for ids, n in asks]
    assert "has no sequence pool" in out


def test_more_active_sequences_than_slots_is_refused(tiny_pool_bundle):
    r = subprocess.run([str(Path(sys.executable).with_name("k3c")), "serve", str(tiny_pool_bundle.root),
                        "--max-active", "9"], capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "more than the 8 sequences" in lines[0], r.stderr


def metric(server, name: str) -> float:
    for line in httpx2.get(f"{server}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def active_sequences(server) -> float:
    return metric(server, "k3c_active_sequences")


def test_a_client_that_goes_away_frees_its_place(client, server):
    with httpx2.stream("POST", f"{server}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": prompt(3, 8), "max_tokens": 4000, "temperature": 0, "stream": True,
                             "logit_bias": {str(EOS): -100}}, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert active_sequences(server) == 1
    deadline = time.monotonic() + 30
    while active_sequences(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert active_sequences(server) == 0
    with concurrent.futures.ThreadPoolExecutor(8) as pool:    # every slot free again: 8 at once all answer
        done = list(pool.map(lambda i: client.completions.create(model="k3-tiny", prompt=[5, 6 + i], max_tokens=2),
                             range(8)))
    assert all(r.usage.completion_tokens >= 1 for r in done)


BAD = [
    ("malformed JSON", b"{\"prompt\": [1, 2", 400, None),
    ("a prompt of the wrong type", {"prompt": {"a": 1}}, 400, "prompt"),
    ("temperature below 0", {"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ("top_p of 0", {"prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ("more than one choice", {"prompt": [1, 2], "n": 2}, 400, "n"),
    ("max_tokens of 0", {"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ("five stop strings", {"prompt": [1, 2], "stop": list("abcde")}, 400, "stop"),
    ("a token id past the vocabulary", {"prompt": [1, 600]}, 400, "prompt"),
    ("a prompt past the context", {"prompt": [7] * 4096}, 400, "prompt"),
    ("an empty prompt", {"prompt": []}, 400, "prompt"),
    ("a logit bias past 100", {"prompt": [1, 2], "logit_bias": {"5": 101}}, 400, "logit_bias"),
]


@pytest.mark.parametrize("what, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_an_error_object_and_the_server_serves_on(server, client, what, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}"}
    if isinstance(body, bytes):
        r = httpx2.post(f"{server}/v1/completions", content=body, headers=headers | {"content-type": "application/json"})
    else:
        r = httpx2.post(f"{server}/v1/completions", json=body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param, error
    assert client.completions.create(model="k3-tiny", prompt=[1, 2], max_tokens=1).choices[0].finish_reason


def test_chat_errors(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx2.post(f"{server}/v1/chat/completions", json={"messages": []}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx2.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]},
                   headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_the_key_is_needed(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx2.get(f"{server}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx2.get(f"{server}/health").status_code == 200


def test_metrics(server, client):
    client.completions.create(model="k3-tiny", prompt=[1, 2, 3], max_tokens=3, temperature=0)
    text = httpx2.get(f"{server}/metrics").text
    assert 'k3c_requests_total{endpoint="/v1/completions",status="200"}' in text
    count = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert count["k3c_time_to_first_token_seconds_count"] >= 1 and count["k3c_inter_token_latency_seconds_count"] >= 2
    assert count["k3c_generated_tokens_total"] >= 3 and count["k3c_queue_length"] == 0


def test_a_full_server_answers_429(tiny_pool_bundle):
    proc, url = start_server(tiny_pool_bundle, "--max-active", "1", "--max-queue", "0")
    try:
        with httpx2.stream("POST", f"{url}/v1/completions", timeout=60,   # its end of sequence barred: it runs on
                           json={"prompt": [1, 2], "max_tokens": 4000, "temperature": 0, "stream": True,
                                 "logit_bias": {str(EOS): -100}}) as busy:
            lines = busy.iter_lines()     # kept: closing it would close the stream
            assert next(line for line in lines if line.startswith("data: "))
            r = httpx2.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_exceeded"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert json.loads(r.text)["error"]["message"].startswith("the server is full")

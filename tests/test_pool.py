"""The sequence pool for serving (exporter/entry_points.Pool, ``k3c compile --max-batch``): a decode
step over sequences of different lengths, each in its slot, equals each sequence decoded alone by
the reference model, run eagerly (the exported programs) and compiled (every batch size the module
has, padding rows on the free slots, sequences leaving and joining); the pool's options and a
step's inputs are checked."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from k3c.artifacts.bundle import Manifest
from k3c.cli import main
from k3c.errors import K3Error
from k3c.exporter.entry_points import Pool
from k3c.exporter.export import (MoveSequence, PooledDecode, Program, PutSequence, example_state, layer_bodies,
                                 stacked_state)
from k3c.model import K3Config, K3Model
from k3c.model.checkpoint import load_checkpoint
from k3c.model.init import init_weights
from k3c.runtimes.session import Session
from test_layer_runs import deeper


@pytest.mark.parametrize("max_batch, batches", [(1, (1,)), (4, (1, 2, 4)), (6, (1, 2, 4, 6)), (8, (1, 2, 4, 8))])
def test_batch_sizes_are_powers_of_two_and_the_largest(max_batch, batches):
    assert Pool(context=16, max_batch=max_batch).batches == batches


def pooled_steps(put, move, step, decode_alone, prompts, rng):
    """Sequences of the given prompt lengths put into slots 0, 1, ...; then decode steps as the
    serving engine takes them, each over the pooled sequences in the first slots: all of them
    (padded to the next batch size), then after sequence 0 and then 1 leave (the last sequence
    moved into each freed slot), after a new one joins. ``step(tokens, positions)`` is the pooled
    step; each of its rows is checked by ``decode_alone(sequence, token)``, that sequence's own
    decode alone, with the same token."""
    pooled, positions = list(range(len(prompts))), list(prompts)
    for slot, length in enumerate(prompts):
        put(slot, length)

    def decode():
        tokens = [int(t) for t in rng.integers(0, 512, len(pooled))]
        got = step(tokens, [positions[q] for q in pooled])
        for row, q in enumerate(pooled):
            decode_alone(q, tokens[row], got[row])
            positions[q] += 1

    def leave(q):
        hole, last = pooled.index(q), pooled.pop()
        if last != q:
            move(len(pooled), hole)
            pooled[hole] = last

    decode()
    leave(0)
    decode()
    leave(1)
    decode()
    prompts.append(4)
    positions.append(4)
    put(len(pooled), 4)
    pooled.append(len(prompts) - 1)
    decode()
    decode()


@pytest.mark.parametrize("n", [6, 13])
def test_pooled_steps_equal_each_sequence_alone_eagerly(n):
    """Three sequences of 5, 9 and 3 tokens in a pool of 4 (``pooled_steps``: batches of 4 with a
    padding row, 2 and 1, a sequence joining) give each sequence's K3Model.decode alone, in
    float64; 13 layers put AttnRes block closings at other loop offsets."""
    torch.manual_seed(0)
    cfg = deeper(K3Config.preset("k3-tiny"), n)
    model = init_weights(K3Model(cfg), seed=0).double().eval()
    pool = Pool(context=32, max_batch=4)
    bodies = layer_bodies(model, weights=True, batches=pool.batches)
    tensors = [t.double() if t.is_floating_point() else t for t in example_state(model, pool.max_batch, pool.context)]
    names = Program(model, "decode").state_names
    states = {}

    def put(slot, length):
        _, states[len(states)] = model.prefill(torch.randint(0, cfg.vocab_size, (1, length)))
        PutSequence(names)(torch.tensor([slot]), *stacked_state(states[len(states) - 1]), *tensors)

    def step(tokens, positions):
        batch = next(b for b in pool.batches if b >= len(tokens))
        valid = torch.zeros(batch, max(positions), dtype=torch.long)
        for i, p in enumerate(positions):
            valid[i, :p] = 1
        padded = torch.tensor(tokens + [0] * (batch - len(tokens))).unsqueeze(1)
        return PooledDecode(model, batch, bodies)(padded, valid, *tensors)[:, 0]

    def decode_alone(q, token, got):
        want, states[q] = model.decode(torch.tensor([[token]]), states[q])
        torch.testing.assert_close(got, want[0, -1], rtol=1e-10, atol=1e-10)

    with torch.no_grad():
        pooled_steps(put, lambda src, dst: MoveSequence()(torch.tensor([src]), torch.tensor([dst]), *tensors),
                     step, decode_alone, [5, 9, 3], np.random.default_rng(0))


def test_compiled_pooled_steps_equal_each_sequence_alone(tiny_pool_bundle):
    """Five sequences of 1 to 700 tokens (a prompt past the bundle's max prompt goes through
    extend) in the compiled pool of 8 (``pooled_steps``: batches of 8 with padding rows, 4, 2 and
    3 of 4) give each one's K3Model decode alone within validate's CPU tolerance, and its greedy
    token."""
    session = Session(tiny_pool_bundle)
    model = load_checkpoint(tiny_pool_bundle.checkpoint_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    states = {}

    def put(slot, length):
        ids = rng.integers(0, 512, length)
        session.prefill(ids, last_only=True)
        session.put(slot)
        states[len(states)] = model.prefill(torch.from_numpy(ids)[None])[1]

    def decode_alone(q, token, got):
        want, states[q] = model.decode(torch.tensor([[token]]), states[q])
        want = want[0, -1].numpy()
        assert np.abs(got - want).max() < 1e-4 and got.argmax() == want.argmax()

    with torch.no_grad():
        pooled_steps(put, session.move, session.decode_pooled, decode_alone, [1, 700, 37, 130, 2], rng)


@pytest.mark.parametrize("call, words", [
    (lambda s: s.decode_pooled([1] * 9, [3] * 9), "1 to 8 sequences"),
    (lambda s: s.decode_pooled([1, 2], [3]), "each with its position"),
    (lambda s: s.decode_pooled([1], [4096]), "positions lie in [1, 4096)"),
    (lambda s: s.decode_pooled([1], [0]), "positions lie in [1, 4096)"),
    (lambda s: s.move(8, 0), "slots lie in [0, 8)"),
    (lambda s: s.put(0), "prefill first"),
], ids=["past the largest batch", "a position short", "full slot", "empty slot", "past the slots", "nothing to put"])
def test_a_bad_pooled_call_is_refused(tiny_pool_bundle, call, words):
    with pytest.raises(K3Error) as e:
        call(Session(tiny_pool_bundle))
    assert words in str(e.value)


def test_validate_runs_the_pool_at_its_largest_batch(tiny_pool_bundle):
    r = CliRunner().invoke(main, ["validate", str(tiny_pool_bundle.root)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert sum("pooled" in line and "PASS" in line for line in lines) == 8 and lines[-1] == "PASS"


@pytest.mark.parametrize("args, words", [
    (["--slot-context", "64"], "give --max-batch"),
    (["--max-batch", "2", "--slot-context", "5000"], "must lie in [2, 4096]"),
    (["--max-batch", "2", "--devices", "2"], "spans several"),
    (["--max-batch", "2", "--target", "vulkan"], "for the CPU targets only"),
], ids=["context without a pool", "context past the model's", "several devices", "a GPU target"])
def test_pool_options_are_checked_before_any_work(tmp_path, args, words):
    r = CliRunner().invoke(main, ["compile", "--preset", "k3-tiny", "-o", str(tmp_path / "b"), *args])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], r.stderr
    assert not (tmp_path / "b").exists()


def test_a_manifest_pool_of_other_fields_is_refused():
    raw = {"config": {}, "config_hash": "", "checkpoint_hash": "", "checkpoint": "", "entry_points": {},
           "target": {"name": "cpu", "backend": "llvm-cpu", "driver": "local-task", "flags": []}, "batch": 1,
           "max_prompt": 8, "parameters": {}, "weights": ""}
    assert Manifest.from_raw({**raw, "pool": {"context": 8, "max_batch": 2}}).pool["max_batch"] == 2
    for pool in ({"context": 0, "max_batch": 2}, {"context": 8}, {"context": 8, "max_batch": True},
                 {"context": 8, "max_batch": 2, "slots": 2}):
        with pytest.raises(K3Error, match="field 'pool'"):
            Manifest.from_raw({**raw, "pool": pool})


def test_compile_says_the_pool_size():
    """k3-tiny's pool at 8 sequences of 4,096 tokens, as export lists it: 4 KDA layers' windows
    [8, 3, 64, 3] and S [8, 2, 32, 32], 2 MLA layers' caches [8, 4096, 40], float32."""
    from k3c.interface.build import log_pool, pool_bytes

    points = {"pool": "(4, 8, 3, 64, 3):float32, (4, 8, 2, 32, 32):float32, (2, 8, 4096, 40):float32"}
    size = 4 * (4 * 8 * 3 * 64 * 3 + 4 * 8 * 2 * 32 * 32 + 2 * 8 * 4096 * 40)
    assert pool_bytes(points) == size and pool_bytes({}) == 0
    said = []
    log_pool(Pool(context=4096, max_batch=8), points, said.append)
    assert said == [f"sequence pool: 8 sequences of 4,096 tokens, {size / 2**20:,.1f} MiB on the device"]

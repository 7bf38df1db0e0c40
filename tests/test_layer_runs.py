"""The layers as runs (model/stacking.py ``layer_runs``) and the entry points written over them
(exporter/export.py ``Program``), run eagerly against the reference model's own layer loop."""
import dataclasses

import pytest
import torch

from k3c.exporter.export import Program, layer_bodies, stacked_state
from k3c.model import K3Config, K3Model
from k3c.model.config import every_fourth_and_last
from k3c.model.init import init_weights
from k3c.model.stacking import LayerRun, group_name, layer_runs


def deeper(cfg: K3Config, n: int) -> K3Config:
    full = every_fourth_and_last(n)
    plan = {"full_attn_layers": full, "kda_layers": [i for i in range(1, n + 1) if i not in full]}
    return dataclasses.replace(cfg, num_hidden_layers=n, linear_attn_config={**cfg.linear_attn_config, **plan})


def test_k3_runs_by_hand():
    # K3: layer 0 dense KDA; MLA at 1-indexed 4, 8, ..., 92 and 93 -> 0-indexed 3, 7, ..., 91, 92.
    # From layer 1 the groups repeat as [KDA, KDA, MLA, KDA] up to layer 88; 89-92 are KDA, KDA, MLA, MLA.
    runs = layer_runs(K3Config())
    assert runs == [LayerRun(0, 1, 1), LayerRun(1, 4, 22), *(LayerRun(i, 1, 1) for i in range(89, 93))]


@pytest.mark.parametrize("n", [1, 2, 6, 8, 13, 32, 93])
def test_runs_cover_layers_in_order_and_repeat(n):
    cfg = deeper(K3Config.preset("k3-tiny"), n)
    runs = layer_runs(cfg)
    layers = [i for r in runs for k in range(r.count) for i in r.layers(k)]
    assert layers == list(range(n))
    for r in runs:
        first = [group_name(cfg, i) for i in r.layers(0)]
        assert all([group_name(cfg, i) for i in r.layers(k)] == first for k in range(r.count))


@pytest.mark.parametrize("n", [6, 13])
def test_program_equals_reference_eagerly(n):
    """Prefill then decode through the entry points (layer loops, bodies over stacked weights, the
    bank as one tensor) equal K3Model.prefill / decode; 13 layers put AttnRes block closings at
    different offsets of the loop's iterations."""
    torch.manual_seed(0)
    cfg = deeper(K3Config.preset("k3-tiny"), n)
    model = K3Model(cfg).double().eval()
    init_weights(model, seed=0)
    assert any(r.count > 1 for r in layer_runs(cfg))
    bodies = layer_bodies(model, weights=True)
    tokens = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        want_logits, want_state = model.prefill(tokens)
        logits, hidden, *state = Program(model, "prefill", bodies=bodies)(tokens)
        torch.testing.assert_close(logits, want_logits, rtol=1e-10, atol=1e-10)
        for got, want in zip(state, stacked_state(want_state)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        token = tokens[:, -1:]
        want_logits, _ = model.decode(token, want_state)
        logits, *_ = Program(model, "decode", bodies=bodies)(token, *state)
        torch.testing.assert_close(logits, want_logits, rtol=1e-10, atol=1e-10)

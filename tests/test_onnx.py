"""The ONNX front end: export (k3 custom ops as nodes of the domain k3, weights as external data in
the checkpoint), onnx's ReferenceEvaluator against the PyTorch model, the round trip through the
ONNX importer, the same passes and iree-compile to a bundle that validates, and bad inputs.

One k3-tiny export (about a minute on 2 cores) serves every test; the round trip compiles once."""
from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from k3c.cli import main
from k3c.exporter.entry_points import REQUIRED
from k3c.exporter.onnx_ops import DOMAIN, reference_evaluator
from k3c.model.checkpoint import load_checkpoint, open_checkpoint

pytestmark = pytest.mark.slow  # every test reads the k3-tiny ONNX export; the round trip compiles it



@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "k3-tiny"
    result = CliRunner().invoke(main, ["export", "--format", "onnx", "--preset", "k3-tiny", "--max-prompt", "32",
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def model(export_dir):
    """The PyTorch model on the export's checkpoint: the weights the ONNX models read."""
    return load_checkpoint(export_dir / "checkpoint")


def test_checker_custom_ops_and_external_weights(export_dir):
    # the export's checkpoint is in K3Model's layout: routed experts stacked, one tensor per matrix
    tensors = {key for header in open_checkpoint(export_dir / "checkpoint").stored.values() for key in header}
    for name in REQUIRED:
        path = export_dir / f"{name}.onnx"
        onnx.checker.check_model(path, full_check=True)
        m = onnx.load(path, load_external_data=False)
        assert {o.domain: o.version for o in m.opset_import} == {"": 20, DOMAIN: 1}
        custom = Counter(n.op_type for n in m.graph.node if n.domain == DOMAIN)
        kda = "KdaChunk" if name == "prefill" else "KdaStep"
        assert custom == {kda: 4, "Mxfp4ExpertFfn": 5}  # k3-tiny: 4 KDA layers, 5 MoE layers
        assert not any(n.op_type in ("Loop", "Scan") for n in m.graph.node)
        external = {t.name: t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
        # every weight the entry point reads, and nothing else, is read from the checkpoint; layer 0
        # has no AttnRes before its attention (the bank is empty, spec section 3), so never reads those
        assert external.keys() <= tensors
        assert tensors - external.keys() == {"model.layers.0.self_attention_res_proj.weight",
                                                    "model.layers.0.self_attention_res_norm.weight"}
        packed = external["model.layers.1.block_sparse_moe.experts.w1.weight_packed"]
        assert packed.data_type == onnx.TensorProto.UINT8 and list(packed.dims) == [8, 32, 16]
        assert {e.key: e.value for e in packed.external_data}["location"] == "checkpoint/model.safetensors"
        inline = sum(t.ByteSize() for t in m.graph.initializer if t.name not in external)
        assert inline < 64_000  # constants only (shape vectors, the zero initial state)


def test_reference_evaluator_matches_pytorch(export_dir, model):
    """Prefill over 70 tokens (two KDA chunks), then two decode steps fed the present state."""
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (1, 70))
    prefill, decode = (reference_evaluator(str(export_dir / f"{n}.onnx")) for n in REQUIRED)
    logits, hidden, *state = prefill.run(None, {"tokens": tokens})
    with torch.no_grad():
        expected, torch_state = model.prefill(torch.from_numpy(tokens))
    np.testing.assert_allclose(logits, expected.numpy(), rtol=0, atol=1e-4)
    past = [i.name for i in onnx.load(export_dir / "decode.onnx", load_external_data=False).graph.input][1:]
    for token in (3, 141):
        logits, *state = decode.run(None, {"token": np.array([[token]]), **dict(zip(past, state))})
        with torch.no_grad():
            expected, torch_state = model.decode(torch.tensor([[token]]), torch_state)
        np.testing.assert_allclose(logits, expected.numpy(), rtol=0, atol=1e-4)
    assert state[-1].shape[1] == 72  # the MLA cache grew by one latent per token


def test_round_trip_compiles_and_validates(export_dir, tmp_path):
    bundle = tmp_path / "bundle"
    runner = CliRunner()
    result = runner.invoke(main, ["compile", "--onnx", str(export_dir), "--target", "cpu", "-o", str(bundle)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["validate", str(bundle)])
    assert result.exit_code == 0 and result.output.strip().endswith("PASS"), result.output
    # parameters are read from the checkpoint at run time, never embedded in the module
    with safe_open(bundle / "checkpoint" / "model.safetensors", framework="pt") as f:
        for name in ("model.embed_tokens.weight", "model.layers.1.block_sparse_moe.experts.w1.weight_packed"):
            assert f.get_tensor(name).view(torch.uint8).numpy().tobytes() not in (bundle / "module.vmfb").read_bytes()


def _broken_copy(export_dir, tmp_path, edit) -> str:
    """A copy of the export with ``edit(prefill ModelProto, copy dir)`` applied to it."""
    copy = tmp_path / "broken"
    shutil.copytree(export_dir, copy)
    m = onnx.load(copy / "prefill.onnx", load_external_data=False)
    edit(m, copy)
    onnx.save(m, copy / "prefill.onnx")
    return str(copy)


def _compile_error(directory) -> str:
    result = CliRunner().invoke(main, ["compile", "--onnx", directory, "--target", "cpu", "-o", directory + "-out"])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


def test_unknown_custom_op_is_named(export_dir, tmp_path):
    def rename(m, _):
        next(n for n in m.graph.node if n.op_type == "KdaChunk").op_type = "KdaMystery"
    assert "unknown custom op k3.KdaMystery" in _compile_error(_broken_copy(export_dir, tmp_path, rename))


def test_missing_external_data_is_named(export_dir, tmp_path):
    def drop_weights(_, copy):
        (copy / "checkpoint" / "model.safetensors").unlink()
    message = _compile_error(_broken_copy(export_dir, tmp_path, drop_weights))
    assert "external data file checkpoint/model.safetensors" in message and "missing" in message


def test_unsupported_opset_is_named(export_dir, tmp_path):
    def old_opset(m, _):
        next(o for o in m.opset_import if o.domain == "").version = 7
    assert "opset ai.onnx version 7" in _compile_error(_broken_copy(export_dir, tmp_path, old_opset))

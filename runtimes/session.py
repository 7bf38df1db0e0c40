"""Session: a bundle loaded on an IREE device; prefill then greedy decode, state kept on the device.

Parameters are read straight from the checkpoint's safetensors files (``iree.runtime.ParameterIndex``,
scope ``model``), so the module and the weights stay separate files.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import numpy as np

from ..artifacts.bundle import Bundle
from ..errors import K3Error
from ..compiler.targets import Target


@dataclass
class Generation:
    """Greedy ids (the first comes from prefill) and timings."""
    ids: list[int]
    n_prompt: int
    prefill_s: float
    decode_s: list[float] = field(default_factory=list)

    @property
    def prefill_tok_s(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tok_s(self) -> float:
        return len(self.decode_s) / sum(self.decode_s) if self.decode_s else float("nan")


def iree_error_line(e: Exception, limit: int = 300) -> str:
    """An IREE runtime error as one readable line: the status and its message, each target attribute
    (``#hal.device.target<"cuda", [#hal.executable.target<..., "cuda-nvptx-fb", {...}>]>``, which
    runs to kilobytes) as its backend and format."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    text = re.sub(r"^Error creating vm context with modules: (<vm>:0: )?", "", text)
    text = re.sub(r'#hal\.device\.target<"([^"]+)", \[#hal\.executable\.target<"[^"]*", "([^"]+)".*?(?=; |$)',
                  r"a module for \1 (\2)", text).rstrip("; ")
    return text if len(text) <= limit else text[:limit] + "..."


class Session:
    def __init__(self, bundle: Bundle):
        import iree.runtime as rt

        from ..compiler.devices import check_device
        from ..model.checkpoint import checkpoint_files
        from .readback import read_back

        m = bundle.manifest
        self.bundle, self.vocab = bundle, m.config["vocab_size"]
        self.max_context = m.config["max_position_embeddings"]
        self.target = m.target
        check_device(Target(**{**m.target, "flags": tuple(m.target["flags"])}))
        self._read_back = read_back
        try:
            self.config = rt.Config(m.target["driver"])
        except (RuntimeError, ValueError) as e:
            raise K3Error(f"run: cannot open IREE driver {m.target['driver']!r} for {m.target['name']}: {e}") from None
        index = rt.ParameterIndex()
        for f in checkpoint_files(bundle.checkpoint_dir):
            index.load(str(f))
        params = rt.create_io_parameters_module(self.config.vm_instance, index.create_provider(scope="model"))
        module = rt.VmModule.copy_buffer(self.config.vm_instance, bundle.module_path.read_bytes())
        try:
            _, self.program = rt.load_vm_modules(params, module, config=self.config)
        except RuntimeError as e:
            raise K3Error(f"run: the module in {bundle.root} does not load with its parameters: "
                          f"{iree_error_line(e)}") from None
        self.state: tuple | None = None
        self.position = 0

    def host(self, array) -> np.ndarray:
        return self._read_back(array)

    def check_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.vocab)]
        if bad.size:
            raise K3Error(f"run: token id {int(bad[0])} is out of range for vocab_size {self.vocab}")
        return ids

    def prefill(self, prompt_ids) -> tuple[np.ndarray, np.ndarray]:
        """Start a sequence: logits [T, vocab] and per-layer hidden states [layers, T, D] on the host."""
        ids = self.check_ids(prompt_ids)
        limit = self.bundle.manifest.max_prompt
        if not 1 <= ids.size <= limit:
            raise K3Error(f"run: prompt of {ids.size} tokens; this bundle's prefill takes 1 to {limit}")
        logits, hidden, *self.state = self.program.prefill(ids[None])
        self.position = ids.size
        return self.host(logits)[0], self.host(hidden)[:, 0]

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; logits [vocab]. The state never leaves the device."""
        if self.state is None:
            raise K3Error("run: decode before prefill")
        if self.position + 1 >= self.max_context:
            raise K3Error(f"run: context full ({self.max_context} tokens)")
        ids = self.check_ids([token])
        logits, *self.state = self.program.decode(ids[None], *self.state)
        self.position += 1
        return self.host(logits)[0, -1]

    def generate(self, prompt_ids, n: int) -> Generation:
        """Greedy: prefill the prompt, then n decode steps; per-step timings."""
        t0 = time.perf_counter()
        logits, _ = self.prefill(prompt_ids)
        gen = Generation([int(logits[-1].argmax())], len(prompt_ids), time.perf_counter() - t0)
        for _ in range(n - 1):
            t0 = time.perf_counter()
            logits = self.decode(gen.ids[-1])
            gen.decode_s.append(time.perf_counter() - t0)
            gen.ids.append(int(logits.argmax()))
        return gen

"""Session: a bundle loaded on an IREE device; prefill (in pieces), extend and decode, the state kept on
the device; generation with a sampler.

Parameters are read from the bundle's packed archive (or an ONNX bundle's checkpoint) (``iree.runtime.ParameterIndex``,
scope ``model``), so the module and the weights stay separate files.
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field

import iree.runtime as rt
import numpy as np

from ..artifacts.bundle import Bundle
from ..compiler.device_limits import limits_of
from ..compiler.devices import check_device, devices, open_devices
from ..compiler.targets import Target
from ..errors import K3Error
from ..exporter.entry_points import MOVE, PUT, pooled_decode
from ..utils.memory import keep_freed_heap
from .device_fit import fit
from .readback import DeviceFunction, load, read_back


@dataclass
class Generation:
    """Generated ids (the first comes from prefill), timings and why generation stopped."""
    ids: list[int]
    n_prompt: int
    prefill_s: float
    decode_s: list[float] = field(default_factory=list)
    finish_reason: str = ""     # eos, stop (a stop string), length (max_new_tokens), context (full)

    @property
    def prefill_tok_s(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tok_s(self) -> float | None:
        """None when there was no decode step (JSON has no NaN)."""
        return len(self.decode_s) / sum(self.decode_s) if self.decode_s else None


def iree_error_line(e: Exception, limit: int = 300) -> str:
    """An IREE runtime error as one readable line: the status and its message, each target attribute
    (``#hal.device.target<"cuda", [#hal.executable.target<..., "cuda-nvptx-fb", {...}>]>``, which
    runs to kilobytes) as its backend and format."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    text = re.sub(r"^Error creating vm context with modules: (<vm>:0: )?", "", text)
    text = re.sub(r'#hal\.device\.target<"([^"]+)", \[#hal\.executable\.target<"[^"]*", "([^"]+)".*?(?=; |$)',
                  r"a module for \1 (\2)", text).rstrip("; ")
    return text if len(text) <= limit else text[:limit] + "..."


# On the CPU a program over several devices runs its devices on local-sync: under IREE 3.13's
# local-task such a decode step fails ("transient buffer has not been committed" in
# hal.device.queue.alloca / dealloca) while prefill runs; local-sync runs both (README "Past one device")
MULTI_DEVICE_DRIVER = {"local-task": "local-sync"}


def extend_pieces(ids: np.ndarray, max_prompt: int) -> list[np.ndarray]:
    """How ``extend`` feeds ``ids``: the fewest pieces of at most ``max_prompt`` tokens, of equal
    length but for one token (the serving engine feeds a prompt the same way, so a sequence served
    beside others computes what it computes alone)."""
    return np.array_split(ids, -(-ids.size // max_prompt))


# IREE 3.13's Vulkan queue sometimes signals a timeline semaphore from the host past a signal the
# device has yet to make (VUID-VkSemaphoreSignalInfo-value-03259), which Mesa's llvmpipe reports as
# a lost device; in k3c it has only been seen while the parameters load (docs/pipeline.md §4).
VULKAN_LOAD_TRIES = 3


def open_config(manifest_target: dict, target: Target, driver: str | None, fresh: bool = False) -> rt.Config:
    """A runtime configuration: the bundle's driver, or ``driver`` for a one-device bundle, on the
    process's cached device, or with ``fresh`` on a new one (a lost device stays lost, and cached);
    a program over several devices gets one HAL module over all of them, its arguments on the
    first."""
    try:
        if target.devices == 1:
            return rt.Config(device=rt.get_device(driver or manifest_target["driver"], cache=not fresh))
        found = open_devices(MULTI_DEVICE_DRIVER.get(target.driver, target.driver), target.devices)
        config = rt.Config(device=found[0])
        config.default_vm_modules = (rt.create_hal_module(config.vm_instance, devices=found),)
        return config
    except (RuntimeError, ValueError) as e:
        raise K3Error(f"run: cannot open IREE driver {manifest_target['driver']!r} for {manifest_target['name']}: "
                      f"{e}") from None


def load_bundle(config: rt.Config, bundle: Bundle) -> tuple[rt.SystemContext, rt.VmModule]:
    """The bundle's module in a context on ``config``'s device, its parameters (scope ``model``)
    read from the bundle's archives; the initializer loading them runs here."""
    index = rt.ParameterIndex()
    for f in bundle.parameter_files:
        index.load(str(f))
    params = rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope="model"))
    module = rt.VmModule.copy_buffer(config.vm_instance, bundle.module_path.read_bytes())
    return load(config, params, module), module


class Session:
    def __init__(self, bundle: Bundle, driver: str | None = None):
        """``driver``: another IREE driver for a one-device bundle's device (the bench runs a
        one-device bundle on the driver a multi-device one uses, to compare like with like)."""
        m = bundle.manifest
        self.bundle, self.vocab = bundle, m.config["vocab_size"]
        self.max_context = m.config["max_position_embeddings"]
        self.context_limit = ""         # why max_context is below the config's, when the device bounds it
        self.target = m.target
        target = Target.from_dict(m.target)
        check_device(target)
        limits = limits_of(devices("vulkan")[0]) if target.driver == "vulkan" else None
        if limits is not None:
            self.max_context, self.context_limit = fit(m, limits, str(bundle.root))
        keep_freed_heap()
        for attempt in range(1, VULKAN_LOAD_TRIES + 1):
            self.config = open_config(m.target, target, driver, fresh=attempt > 1)
            try:
                context, module = load_bundle(self.config, bundle)
                break
            except (RuntimeError, ValueError) as e:
                if not (target.driver == "vulkan" and "DATA_LOSS" in str(e) and attempt < VULKAN_LOAD_TRIES):
                    raise K3Error(f"run: the module in {bundle.root} does not load with its parameters: "
                                  f"{iree_error_line(e)}") from None
                print("warning: the Vulkan device was lost while loading the parameters (a race in IREE "
                      "3.13's Vulkan queue, docs/pipeline.md §4); loading again on a new device", file=sys.stderr)
        self.device = self.config.device
        self._context, self._module_name = context, module.name
        self.pool = bundle.pool
        self.call = {name: DeviceFunction(context, module.name, name) for name in bundle.entry_point_names
                     if name in m.entry_points}
        self.state: tuple | None = None
        self.position = 0

    def layer(self, name: str, *inputs: np.ndarray) -> list[np.ndarray]:
        """Call the layer entry point ``name`` (``layer_<group>``, docs/bundle.md §7) on host arrays;
        its results on the host. The sequence state is untouched."""
        if name not in self.bundle.manifest.entry_points:
            raise K3Error(f"run: {self.bundle.root} has no layer entry point {name} (compiled before "
                          "k3c validate --layers); compile it again")
        if name not in self.call:
            self.call[name] = DeviceFunction(self._context, self._module_name, name)
        return [self.host(v) for v in self.call[name](*inputs)]

    def host(self, view: rt.HalBufferView, last: bool = False) -> np.ndarray:
        """``view`` on the host; with ``last``, of the last position only (axis -2)."""
        return read_back(self.device, view, last)

    def check_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.vocab)]
        if bad.size:
            raise K3Error(f"run: token id {int(bad[0])} is out of range for vocab_size {self.vocab}")
        return ids

    def prefill(self, prompt_ids, last_only: bool = False,
                hidden: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Start a sequence with the prompt: logits [T, vocab] on the host (with ``last_only``, of the
        last position only, [1, vocab]: the other pieces' logits are not read back), and with
        ``hidden`` the per-layer hidden states [layers, T, D] when the prompt fits the ``prefill``
        entry point (at most the bundle's max_prompt tokens; None otherwise: for the full K3 at 4,096
        tokens they are 11 GB, so nothing reads them back unless asked). A longer prompt is
        prefilled in pieces of max_prompt, the first by ``prefill``, the others by ``extend`` from
        the state the piece before left."""
        ids = self.check_ids(prompt_ids)
        if ids.size == 0:
            raise K3Error("run: the prompt is empty")
        self.state, self.position = None, 0
        self._check_room(ids.size)
        first = ids[:self.bundle.manifest.max_prompt]
        logits, states, *self.state = self.call["prefill"](first[None], at=f"tokens 0-{first.size - 1}")
        self.position = first.size
        if first.size == ids.size:
            return self.host(logits, last_only)[0], (self.host(states)[:, 0] if hidden else None)
        rest = self.extend(ids[first.size:], last_only)
        return (rest if last_only else np.concatenate([self.host(logits)[0], rest])), None

    def extend(self, ids, last_only: bool = False) -> np.ndarray:
        """Continue the sequence by ``ids`` (a chat turn, or the rest of a long prompt), in pieces of
        at most max_prompt through the ``extend`` entry point: logits [T, vocab] (``last_only``:
        [1, vocab])."""
        ids = self.check_ids(ids)
        if self.state is None:
            return self.prefill(ids, last_only)[0]
        if ids.size == 0:
            raise K3Error("run: nothing to extend the sequence with (no tokens)")
        if "extend" not in self.bundle.manifest.entry_points:
            raise K3Error(f"run: {self.bundle.root} has no extend entry point (compiled before chunked "
                          f"prefill), so it takes at most {self.bundle.manifest.max_prompt} prompt tokens "
                          "and no chat turns; compile it again")
        self._check_room(ids.size)
        pieces = extend_pieces(ids, self.bundle.manifest.max_prompt)
        out = []
        for i, piece in enumerate(pieces):
            logits, *self.state = self.call["extend"](
                piece[None], *self.state, at=f"tokens {self.position}-{self.position + piece.size - 1}")
            self.position += piece.size
            if not last_only or i == len(pieces) - 1:
                out.append(self.host(logits, last_only)[0])
        return out[0] if last_only else np.concatenate(out)

    def _check_room(self, n: int) -> None:
        why = f" on this device: {self.context_limit}" if self.context_limit else ""
        if self.position == 0 and n > self.max_context:
            raise K3Error(f"run: the prompt has {n} tokens; the context holds {self.max_context}{why}")
        if self.position + n > self.max_context:
            raise K3Error(f"run: {n} more tokens do not fit: the context holds {self.max_context} tokens{why}, "
                          f"{self.position} used, {self.max_context - self.position} free")

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; logits [vocab]. The state never leaves the device."""
        if self.state is None:
            raise K3Error("run: decode before prefill")
        if self.position >= self.max_context:
            raise K3Error(f"run: the context is full: it holds {self.max_context} tokens (prompt and generated)"
                          + (f" on this device: {self.context_limit}" if self.context_limit else ""))
        ids = self.check_ids([token])
        logits, *self.state = self.call["decode"](ids[None], *self.state, at=f"token {self.position}")
        self.position += 1
        return self.host(logits)[0, -1]

    def put(self, slot: int) -> None:
        """Move the sequence (its state as prefill and extend left it) into ``slot`` of the bundle's
        sequence pool, for ``decode_pooled``; the session holds no sequence after."""
        self._check_slots(slot)
        if self.state is None:
            raise K3Error("run: no sequence to put into the pool (prefill first)")
        if self.position > self.pool.context:
            raise K3Error(f"run: the sequence has {self.position} tokens; a pool slot holds {self.pool.context}")
        self.call[PUT](np.array([slot], dtype=np.int64), *self.state, at=f"slot {slot}")
        self.state, self.position = None, 0

    def move(self, src: int, dst: int) -> None:
        """Move the pooled sequence in slot ``src`` into slot ``dst`` (what was in dst is lost)."""
        self._check_slots(src, dst)
        self.call[MOVE](np.array([src], dtype=np.int64), np.array([dst], dtype=np.int64), at=f"slot {src}")

    def _check_slots(self, *slots: int) -> None:
        if self.pool is None:
            raise K3Error(f"run: {self.bundle.root} has no sequence pool (compile it with --max-batch)")
        if not all(0 <= s < self.pool.max_batch for s in slots):
            raise K3Error(f"run: slots lie in [0, {self.pool.max_batch}); got {list(slots)}")

    def decode_pooled(self, tokens: list[int], positions: list[int]) -> np.ndarray:
        """One decode step of the pooled sequences (``put``) in slots 0 to n - 1: each one's token
        and position (the tokens its slot holds); logits [n, vocab]. The step runs on the module's
        smallest batch size that takes them all, the padding rows on the free slots after them."""
        pool, n = self.pool, len(tokens)
        self._check_slots()
        if not 1 <= n <= pool.max_batch or len(positions) != n:
            raise K3Error(f"run: a pooled decode step takes 1 to {pool.max_batch} sequences, each with its "
                          f"position; got {n} tokens and {len(positions)} positions")
        if not all(1 <= p < pool.context for p in positions):
            raise K3Error(f"run: pooled positions lie in [1, {pool.context}); got {positions}")
        batch = next(b for b in pool.batches if b >= n)
        ids = np.zeros((batch, 1), dtype=np.int64)
        ids[:n, 0] = self.check_ids(tokens)
        valid = (np.arange(max(positions)) < np.array(positions + [0] * (batch - n))[:, None]).astype(np.int64)
        (logits,) = self.call[pooled_decode(batch)](ids, valid, at=f"slots 0-{n - 1}")
        return self.host(logits)[:n, 0]

    def generate(self, prompt_ids, max_new_tokens: int, sampler=None, stop_ids=(), on_token=None,
                 continue_sequence: bool = False) -> Generation:
        """Prefill the prompt (or extend the current sequence by it), then choose up to
        ``max_new_tokens`` tokens with ``sampler`` (greedy without one), feeding each one back.
        Stops at a token in ``stop_ids`` (kept as the last id), when ``on_token(id)`` returns True
        (a stop string), or when the context is full: finish_reason eos, stop, length or context.
        The last id is never fed: the state holds the prompt and every id but the last."""
        choose = sampler or (lambda logits: int(np.argmax(logits)))
        t0 = time.perf_counter()
        feed = self.extend if continue_sequence else lambda ids, last: self.prefill(ids, last)[0]
        logits = feed(prompt_ids, True)[-1]
        gen = Generation([], len(prompt_ids), time.perf_counter() - t0)
        while True:
            gen.ids.append(choose(logits))
            if gen.ids[-1] in stop_ids:
                gen.finish_reason = "eos"
            elif on_token is not None and on_token(gen.ids[-1]):
                gen.finish_reason = "stop"
            elif len(gen.ids) >= max_new_tokens:
                gen.finish_reason = "length"
            elif self.position + 1 >= self.max_context:   # the sequence with this id fills the context
                gen.finish_reason = "context"
            if gen.finish_reason:
                return gen
            t0 = time.perf_counter()
            logits = self.decode(gen.ids[-1])
            gen.decode_s.append(time.perf_counter() - t0)

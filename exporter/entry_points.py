"""The entry points of a compiled K3 module (docs/pipeline.md §2), in the order export writes them.
Every module has ``prefill`` and ``decode``; the torch front end adds ``extend`` (a prompt's later
pieces), which the ONNX front end does not export. A module compiled for serving (``Pool``) also
holds a pool of sequences on the device and the entry points that use it: ``put_sequence`` and
one ``decode_b<B>`` per batch size."""
from __future__ import annotations

from dataclasses import asdict, dataclass

ENTRY_POINTS = ("prefill", "extend", "decode")
REQUIRED = ("prefill", "decode")
PUT = "put_sequence"
MOVE = "move_sequence"


def pooled_decode(batch: int) -> str:
    """The entry point of one decode step of ``batch`` pooled sequences."""
    return f"decode_b{batch}"


@dataclass(frozen=True)
class Pool:
    """The sequence pool of a module compiled for serving: the state of ``max_batch`` sequences (KDA
    windows and S matrices, MLA caches of ``context`` tokens each), one per slot, kept in module
    globals on the device. A decode step of B sequences runs on slots 0 to B - 1: the caller keeps
    its sequences in the first slots (``move_sequence`` fills a slot a sequence left), so a step
    reads and writes its state in place, as contiguous slices of the globals.

        put_sequence(slot [1], *state)                    a sequence's state (as prefill and extend
                                                          return it) into its slot
        move_sequence(src [1], dst [1])                   the sequence in slot src into slot dst
        decode_b<B>(tokens [B, 1], valid [B, L])          one decode step of the sequences in slots
                                                          0 to B - 1: logits [B, 1, vocab]

    ``valid[b, j]`` is nonzero for the cache rows j < L that sequence b has (its first ``position``
    rows), so sequences of different lengths share a step; each token's own row is written at its
    position. A row past the sequences (padding up to B) computes on its free slot. B is each
    power of two up to ``max_batch``, and ``max_batch``."""
    context: int
    max_batch: int

    @property
    def batches(self) -> tuple[int, ...]:
        powers = [1 << i for i in range(self.max_batch.bit_length()) if 1 << i < self.max_batch]
        return (*powers, self.max_batch)

    def entry_points(self) -> tuple[str, ...]:
        return (PUT, MOVE, *map(pooled_decode, self.batches))

    def to_dict(self) -> dict:
        return asdict(self)

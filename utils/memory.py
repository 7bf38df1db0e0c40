"""Resident memory of mapped files (docs/bundle.md §7), and the heap that IREE's CPU runtime
allocates from (docs/pipeline.md §6).

A file mapped into the process (IREE's parameter archive, a checkpoint read through safetensors)
counts in its resident set for every page read, and stays counted until it is unmapped. A reader
that goes through such a file once, a layer at a time, can give the pages back as it goes: they
stay in the kernel's page cache, and a later read of the same bytes maps them in again.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def mapped_ranges(paths) -> list[tuple[int, int]]:
    """(start, end) of every read-only mapping in this process of a file in ``paths``."""
    wanted = {os.path.realpath(p) for p in paths}
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "w" not in fields[1] and os.path.realpath(fields[5]) in wanted:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def release_mapped_pages(paths) -> int:
    """Drop this process's resident pages of the files at ``paths`` (read-only data: the mappings
    stay valid and read the same bytes again); returns the bytes of mapping released."""
    released = 0
    for start, end in mapped_ranges(paths):
        if _libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            released += end - start
    return released


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def keep_freed_heap() -> bool:
    """Have glibc keep freed memory in the process's heap for the next allocation; False where the
    C library is not glibc. IREE's CPU runtime allocates each call's transient buffers anew, and
    glibc serves a block over its mmap threshold (at most 32 MiB) with fresh pages and unmaps it
    when freed, so every call faults its working set in again, zero-filled by the kernel: a
    quarter of a k3-small MoE layer's prefill at 8,192 tokens (docs/pipeline.md §6). Served from
    the heap instead, the second call reuses the first call's pages. The process's resident
    memory stays at its peak (as a caching allocator's would)."""
    mallopt = getattr(_libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))

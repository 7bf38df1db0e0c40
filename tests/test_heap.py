"""utils/memory.py keep_freed_heap (docs/pipeline.md §6): a 64 MiB block freed and allocated again
comes back without page faults once the heap is kept, and page-faults in whole before, counted by
the kernel (getrusage's minor faults) in a fresh interpreter each."""
from __future__ import annotations

import subprocess
import sys

import pytest

SIZE = 64 << 20
PAGES = SIZE // 4096

# touch a fresh block, free it, allocate the same size again and touch it: the faults of the second touch
PROBE = f"""
import ctypes, resource, sys
from k3c.utils.memory import keep_freed_heap
if sys.argv[1] == "kept":
    assert keep_freed_heap()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
p = libc.malloc({SIZE}); ctypes.memset(p, 1, {SIZE}); libc.free(p)
q = libc.malloc({SIZE})
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ctypes.memset(q, 2, {SIZE})
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_touch_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_heap_reuses_freed_pages():
    assert second_touch_faults("default") > PAGES // 2   # a fresh mapping: ~16,384 faults
    assert second_touch_faults("kept") < PAGES // 100     # the freed pages again

"""Keep freed host memory in the process (glibc ``mallopt``), for CPU runs of the schedules that
hold activations across denoising steps.

Retain keeps every trained step's saved tensors from the rollout to the update (hundreds of MiB
on the bench's tiny FLUX), then frees them. With glibc's defaults that memory goes back to the
kernel when it is freed (heap trimming, and a per-allocation ``mmap`` for blocks above a
threshold that adapts as the program runs), so the next rollout takes a page fault, and a page
zeroed by the kernel, for every 4 KiB it writes: measured on the bench's tiny FLUX under
Inductor, about 10-20 thousand faults and 0.1-0.2 s of system time per iteration, against none
for recompute, whose activations live one step. A CUDA run never sees this (the caching
allocator keeps device memory); on CPU it is the host allocator's policy, the same one that
PyTorch's CPU performance guidance changes with jemalloc or tcmalloc and their decay settings.

:func:`keep_freed_memory` sets the two glibc parameters that matter, for the whole process:

- ``M_TRIM_THRESHOLD``: how much free memory at the top of a heap is kept before it is handed
  back; set to ``trim_threshold`` (default 2 GiB - 1, i.e. keep it).
- ``M_MMAP_THRESHOLD``: blocks at least this large get their own ``mmap`` (and their own page
  faults every time); set to ``mmap_threshold`` (default 32 MiB, glibc's largest allowed on 64-bit
  and the value its adaptive threshold grows to). Setting either one turns off glibc's adaptive
  threshold, so both are set together.

The cost is resident memory: the process keeps its peak instead of shrinking after a step. It is
never called at import; ``leancompile bench grpo`` and ``bench loop`` call it unless given
``--malloc default``, and say so in their output. Elsewhere (musl, macOS, Windows)
it does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 << 20  # glibc: HEAP_MAX_SIZE / 2 on 64-bit


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = ctypes.CFUNCTYPE(ctypes.c_char_p)(("gnu_get_libc_version", libc))
        version()
    except (OSError, AttributeError):
        return None  # not glibc (musl has no gnu_get_libc_version)
    return libc


def keep_freed_memory(*, trim_threshold: int = 2**31 - 1,
                      mmap_threshold: int = _MAX_MMAP_THRESHOLD) -> bool:
    """Tell glibc's ``malloc`` to keep freed memory for reuse instead of returning it to the
    kernel (process-wide; see the module docstring). Returns True if both parameters were set,
    False where the C library is not glibc. Raises ``ValueError`` for values glibc would
    silently refuse."""
    if not 0 <= trim_threshold <= 2**31 - 1:
        raise ValueError(f"trim_threshold={trim_threshold}: give 0 .. 2**31 - 1 bytes")
    if not 0 < mmap_threshold <= _MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap_threshold={mmap_threshold}: glibc accepts 1 .. "
                         f"{_MAX_MMAP_THRESHOLD} bytes (32 MiB) on 64-bit")
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    return mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok

"""Host memory while large files are read: hand back the pages of memory-mapped tensors, return freed
heap memory to the kernel, and measure each phase's peak resident set (consolidation, its benchmark)."""

import contextlib
import ctypes
import gc
import os
import sys
from pathlib import Path

MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages now; never loses data


def _libc():
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def page_out(tensors) -> None:
    """Hand the resident pages behind memory-mapped tensors back to the kernel.

    They are re-read from the file if touched again. MADV_PAGEOUT cannot lose data:
    on anonymous memory without swap it does nothing. A no-op off Linux.
    """
    libc = _libc()
    if libc is None:
        return
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    for t in tensors:
        ptr, size = t.data_ptr(), t.numel() * t.element_size()
        start, end = -(-ptr // page) * page, (ptr + size) // page * page
        if end > start:
            libc.madvise(start, end - start, MADV_PAGEOUT)


def map_large_allocations(threshold: int = 2**20) -> None:
    """Give every allocation over ``threshold`` bytes its own mapping, returned to the kernel when freed.

    glibc otherwise raises its mmap threshold after the first large free, up to 32 MB, and
    serves tensors below it from a heap that keeps freed memory: DeepSpeed's reader for ZeRO 1/2
    loads the model-states file whole and frees it just before merging the fp32 partitions,
    which without this costs a second copy of the weights.
    """
    libc = _libc()
    with contextlib.suppress(AttributeError):
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD


def trim() -> None:
    """Return freed heap memory to the kernel (glibc keeps it otherwise)."""
    gc.collect()
    libc = _libc()
    with contextlib.suppress(AttributeError):
        libc.malloc_trim(0)


class PeakRSS:
    """Peak resident memory (MB) of each phase: /proc's high-water mark, reset between phases (Linux).

    The reset also lowers what getrusage reports for the process afterwards: the whole run's
    peak is the largest phase's (everything before the first phase is imports and metadata).
    """

    def __init__(self):
        self.phases: dict[str, int] = {}

    @staticmethod
    def _hwm() -> int | None:
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
        return None

    @contextlib.contextmanager
    def phase(self, name: str):
        trim()
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        yield
        if (peak := self._hwm()) is not None:
            self.phases[name] = peak

"""What this CPU can do, read once from the OS (the dtype default and the native kernels' build key)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

__all__ = ("cpu_flags", "has_native_bf16")

# x86 flags of bf16 arithmetic in hardware: AVX512-BF16 dot products, AMX tiles.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` line of /proc/cpuinfo (Linux); empty where the OS does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True where bf16 matmuls run in hardware; elsewhere they are emulated and slower than fp32."""
    return platform.machine().lower() in ("x86_64", "amd64") and bool(
        NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags)
    )

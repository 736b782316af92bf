"""What the Triton launchers share: whether triton is installed, the kernels' module, `tl.arange` sizes.

The kernels' module imports triton, so it is imported on first use: the package is optional (CUDA builds of
torch ship it), and its interpreter (`TRITON_INTERPRET=1`, which the CPU tests run) is chosen when the kernels
are decorated.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

__all__ = ("power_of_two", "triton_available", "triton_kernels")


def triton_available() -> bool:
    """Whether the `triton` package is installed."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def triton_kernels() -> Any:
    """`tokenflow.runtime.gpu.triton_kernels`, imported (and so decorated) once."""
    from tokenflow.runtime.gpu import triton_kernels as kernels

    return kernels


def power_of_two(n: int) -> int:
    """The smallest power of two >= `n` (`tl.arange` takes powers of two only)."""
    return 1 << max(0, n - 1).bit_length()

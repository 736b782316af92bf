"""bf16 decode attention on CPU in a small C kernel (`paged_decode.c`), compiled here at first use.

Why: with torch ops, each layer of a decode step gathers every sequence's KV blocks into a copy
padded to the longest context, transposes it head-major, and runs two batched products that
read it again. The kernel reads each sequence's keys and values once, in place, for its own
length only. Measured on the 2-core CPU, SmolLM2-135M shapes (9 query heads, 3 KV heads,
head_dim 64), 16 decodes over 50-650 keys in shuffled blocks: 500 us a layer with torch ops,
190 us with the kernel.

Build: `$CC` (default `cc`) with `-O3 -march=native -ffast-math -fopenmp -DHEAD_DIM=<d>` (a
constant head size lets the compiler unroll the row loops: 2x faster than a runtime one), cached
under `tokenflow_home()/kernels` by a hash of the source, flags, compiler and CPU, so each
machine builds it once per head size (~0.2 s). The library's OpenMP dependency resolves to the libgomp torch already
loaded, so the kernel shares torch's threads. Without a compiler, a failed build, or a torch
that does not use libgomp, `load_paged_decode()` returns None and attention stays on torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenflow.models.cache import tokenflow_home

__all__ = ("PagedDecode", "load_paged_decode")

log = logging.getLogger("tokenflow")

SOURCE = Path(__file__).with_name("paged_decode.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked in a separate step without -ffast-math: linking with it adds gcc's crtfastmath.o, whose
# constructor sets flush-to-zero for the whole process and would change every float op in it.
LINK_FLAGS = ("-shared", "-fopenmp")

_P = ctypes.c_void_p
_I = ctypes.c_int64


class PagedDecode:
    """The loaded kernel: single-token bf16 attention of `n` sequences over the paged cache."""

    def __init__(self, library: ctypes.CDLL, path: Path, head_dim: int) -> None:
        self.path = path
        self.head_dim = head_dim  # the one head size this build serves
        self._fn = library.paged_decode_bf16
        self._fn.argtypes = (_P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P)
        self._fn.restype = ctypes.c_int

    def __call__(
        self,
        q: torch.Tensor,  # [n, KVH, G, D] bf16
        k_slots: torch.Tensor,  # [num_slots, KVH, D] bf16, contiguous
        v_slots: torch.Tensor,
        tables: torch.Tensor,  # [n, max_blocks] int64
        lengths: torch.Tensor,  # [n] int64, each in 1 .. max_length
        max_length: int,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """Returns `[n, KVH, G, D]`. The caller guarantees the geometry (the runner builds every index)."""
        n, kv_heads, group, head_dim = q.shape
        q = q.contiguous()
        if not (k_slots.is_contiguous() and v_slots.is_contiguous() and tables.is_contiguous()):
            raise ValueError("paged_decode needs contiguous cache and block tables")
        out = torch.empty_like(q)
        scratch = torch.empty(n * kv_heads * group * (2 * head_dim + max_length), dtype=torch.float32)
        status = self._fn(
            q.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(), tables.data_ptr(), tables.shape[1],
            lengths.data_ptr(), n, kv_heads, group, head_dim, block_size, max_length, scale,
            scratch.data_ptr(), out.data_ptr(),
        )
        if status != 0:
            raise ValueError(f"paged_decode was built for head_dim {self.head_dim}, got {head_dim}")
        return out


def _libgomp_paths() -> set[str]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines() if "libgomp" in line.rsplit("/", 1)[-1]}


def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    """Hash of what the library depends on: source, flags, compiler version, CPU features."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join((*flags, *LINK_FLAGS)).encode())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest.update(version.encode())
    digest.update(platform.machine().encode())
    try:
        cpu_flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        cpu_flags = platform.processor()
    digest.update(cpu_flags.encode())
    return digest.hexdigest()[:16]


def _build(compiler: str, folder: Path, head_dim: int) -> Path:
    """Compile the kernel for `head_dim` into `folder` (once: an existing build with the same key is reused)."""
    flags = (*FLAGS, f"-DHEAD_DIM={head_dim}")
    target = folder / f"paged_decode-d{head_dim}-{_build_key(compiler, flags)}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    obj = tmp[: -len(".so.tmp")] + ".o"
    try:
        compile_step = [compiler, *flags, "-c", "-o", obj, str(SOURCE)]
        link_step = [compiler, *LINK_FLAGS, "-o", tmp, obj, "-lm"]
        for command in (compile_step, link_step):
            proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise OSError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each write their own temporary file
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


@functools.cache
def load_paged_decode(head_dim: int) -> PagedDecode | None:
    """The kernel compiled for `head_dim`, or None (logged) where it cannot be built or would bring its own OpenMP."""
    torch_gomp = _libgomp_paths()
    if len(torch_gomp) != 1:
        log.info("native decode attention off: torch does not use libgomp here (%s)", sorted(torch_gomp) or "none")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("native decode attention off: no C compiler (set CC)")
        return None
    try:
        path = _build(compiler, tokenflow_home() / "kernels", head_dim)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native decode attention off: %s", e)
        return None
    if _libgomp_paths() != torch_gomp:  # loaded, but bound to a second OpenMP runtime: leave it unused
        log.warning("native decode attention off: the kernel loaded a second OpenMP runtime")
        return None
    log.info("native decode attention: %s", path)
    return PagedDecode(library, path, head_dim)

"""Attention and norm kernels for CPU in a small C library (`cpu_kernels.c`), compiled here at first use.

Why: with torch ops, each layer of a decode step gathers every sequence's KV blocks into a copy
padded to the longest context, transposes it head-major, and runs two batched products that
read it again; the decode kernel reads each sequence's keys and values once, for its own length
only. The prefill kernel (fp32, and bf16 with AVX512-BF16) does a chunk's whole causal attention
over the cache: torch's fused CPU attention runs these narrow heads far below the FMA rate, and
the matmul path gathers the blocks and masks first. Without it, bf16 prefill tiles keep torch's
matrix products and do scale, causal mask, softmax and rounding between them in one pass instead
of four ops. RMSNorm is one call instead of ~9 ops.

Build: `$CC` (default `cc`) with `-O3 -march=native -ffast-math -fopenmp -DHEAD_DIM=<d>
-DGROUP=<g>` (constants let the compiler unroll and vectorise the row loops, which runtime sizes
prevent), cached under `tokenflow_home()/kernels` by a hash of the source, flags, compiler and CPU,
so a machine builds it once per head geometry. The library's OpenMP dependency resolves to
the libgomp torch already loaded, so the kernels share torch's threads. Without a compiler, a
failed build, or a torch that does not use libgomp, `load_native_kernels()` returns None and
everything stays on torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenflow.hub.cache import tokenflow_home
from tokenflow.progress import StageBar
from tokenflow.runtime.cpu.features import cpu_flags
from tokenflow.runtime.cpu.openmp_team import loaded_libgomp_paths

__all__ = ("FLAGS", "NativeKernels", "isa_restricted", "load_library", "load_native_kernels")

log = logging.getLogger("tokenflow")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# `TOKENFLOW_KERNEL_CFLAGS` adds flags (shell words) after these: e.g. "-mno-avx512f" builds the AVX2 branches
# on an AVX-512 host, "-mno-avx2 -mno-avx512f" the plain ones; CI builds and tests each, so every branch runs.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC",
         *shlex.split(os.environ.get("TOKENFLOW_KERNEL_CFLAGS", "")))


def isa_restricted() -> bool:
    """Whether `TOKENFLOW_KERNEL_CFLAGS` turns off instruction sets this CPU has (then a kernel this CPU could
    run may be missing from the build, and says so)."""
    return any(flag.startswith("-mno-") for flag in FLAGS)
# Linked in a separate step without -ffast-math: linking with it adds gcc's crtfastmath.o, whose
# constructor sets flush-to-zero for the whole process and would change every float op in it.
LINK_FLAGS = ("-shared", "-fopenmp")

_P = ctypes.c_void_p
_I = ctypes.c_int64


class NativeKernels:
    """The loaded library for one head geometry (`head_dim`, `group` query heads per KV head)."""

    def __init__(self, library: ctypes.CDLL, path: Path, head_dim: int, group: int) -> None:
        self.path = path
        self.head_dim = head_dim
        self.group = group
        self._decode = library.paged_decode_bf16
        self._decode.argtypes = (_P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P)
        self._decode.restype = ctypes.c_int
        self._decode_f32 = library.paged_decode_f32
        self._decode_f32.argtypes = self._decode.argtypes
        self._decode_f32.restype = ctypes.c_int
        self._decode_i8 = library.paged_decode_i8
        self._decode_i8.argtypes = (_P, ctypes.c_int, _P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I,
                                    ctypes.c_float, _P, _P)
        self._decode_i8.restype = ctypes.c_int
        self._softmax = library.causal_softmax_bf16
        self._softmax.argtypes = (_P, _I, _I, _I, _I, ctypes.c_float)
        self._softmax.restype = ctypes.c_int
        prefill_args = (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P)
        self._prefill = {torch.float32: library.paged_prefill_f32, torch.bfloat16: library.paged_prefill_bf16}
        for kernel in self._prefill.values():
            kernel.argtypes = prefill_args
            kernel.restype = ctypes.c_int
        # Caches the prefill kernel takes: its register tiles are 16 floats wide, and its bf16 form needs
        # AVX512-BF16; other dtypes and head sizes keep the torch-ops attention.
        library.prefill_bf16_available.restype = ctypes.c_int
        dtypes = {torch.float32, torch.bfloat16} if library.prefill_bf16_available() else {torch.float32}
        self.prefill_dtypes = frozenset(dtypes if head_dim % 16 == 0 else ())
        self._prefill_i8 = library.paged_prefill_i8
        self._prefill_i8.argtypes = (_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P)
        self._prefill_i8.restype = ctypes.c_int
        self._rms_norm = library.rms_norm
        self._rms_norm.argtypes = (_P, ctypes.c_int, _P, _I, _I, ctypes.c_float, _P)
        self._rms_norm.restype = None
        self._head_rms_norm = library.head_rms_norm
        self._head_rms_norm.argtypes = (_P, ctypes.c_int, _I, _I, _I, _P, ctypes.c_float)
        self._head_rms_norm.restype = None
        self._rope = library.rope
        self._rope.argtypes = (_P, ctypes.c_int, _I, _I, _I, _P, _P)
        self._rope.restype = None
        self._write_kv = library.write_kv
        self._write_kv.argtypes = (_P, _P, _I, _I, _I, _I, _P, _P, _P)
        self._write_kv.restype = None
        self._silu_mul = library.silu_mul
        self._silu_mul.argtypes = (_P, ctypes.c_int, _I, _I, _P)
        self._silu_mul.restype = None
        # decode_layers (tokenflow.runtime.cpu.decode_layers builds its arguments and calls it)
        self.decode_layers = library.decode_layers
        self.decode_layers.argtypes = (_P, _I, _P, ctypes.c_int, _P, _I, _I, _I, _I, ctypes.c_float, _P, _P, _P, _P,
                                       _I, _P, _I, _I, _P, _P)
        self.decode_layers.restype = ctypes.c_int

    def _geometry(self, q: torch.Tensor) -> tuple[int, int, int, int]:
        """(n, kv_heads, group, head_dim) of decode queries `[n, KVH, G, D]`, checked against the build's."""
        n, kv_heads, group, head_dim = q.shape
        if (head_dim, group) != (self.head_dim, self.group):
            raise ValueError(f"built for head_dim {self.head_dim}, group {self.group}; got {head_dim}, {group}")
        return n, kv_heads, group, head_dim

    def decode(
        self,
        q: torch.Tensor,  # [n, KVH, G, D] bf16 or fp32 (the caches' dtype); rows may be strided (a QKV view)
        k_slots: torch.Tensor,  # [num_slots, KVH, D] bf16, contiguous
        v_slots: torch.Tensor,
        tables: torch.Tensor,  # [n, max_blocks] int64
        lengths: torch.Tensor,  # [n] int64, each in 1 .. max_length
        max_length: int,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """Single-token attention of `n` sequences over the paged cache; returns `[n, KVH, G, D]`.

        The caller guarantees that the tables and lengths index the cache (the runner builds them).
        """
        n, kv_heads, group, head_dim = self._geometry(q)
        if not (k_slots.is_contiguous() and v_slots.is_contiguous() and tables.is_contiguous()):
            raise ValueError("paged decode needs a contiguous cache and block tables")
        if not (q.dtype == k_slots.dtype == v_slots.dtype and q.dtype in (torch.bfloat16, torch.float32)):
            raise ValueError(f"paged decode needs bf16 or fp32 queries and caches, got {q.dtype}, {k_slots.dtype}")
        if q.stride()[1:] != (group * head_dim, head_dim, 1):  # each sequence's heads must be contiguous
            q = q.contiguous()
        out = torch.empty((n, kv_heads, group, head_dim), dtype=q.dtype)
        scratch = torch.empty(n * kv_heads * group * (2 * head_dim + 2 * max_length + 2), dtype=torch.float32)
        kernel = self._decode if q.dtype == torch.bfloat16 else self._decode_f32
        status = kernel(
            q.data_ptr(), q.stride(0), k_slots.data_ptr(), v_slots.data_ptr(), tables.data_ptr(), tables.shape[1],
            lengths.data_ptr(), n, kv_heads, group, head_dim, block_size, max_length, scale,
            scratch.data_ptr(), out.data_ptr(),
        )
        if status != 0:
            raise MemoryError("paged decode: out of memory")  # the geometry was checked above
        return out

    def decode_int8(
        self,
        q: torch.Tensor,  # [n, KVH, G, D] bf16 or fp32
        k_slots: torch.Tensor,  # [num_slots, KVH, D] int8, contiguous
        v_slots: torch.Tensor,
        k_scales: torch.Tensor,  # [num_slots, KVH] fp32, contiguous
        v_scales: torch.Tensor,
        tables: torch.Tensor,  # [n, max_blocks] int64
        lengths: torch.Tensor,  # [n] int64, each in 1 .. max_length
        max_length: int,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """`decode` over an int8 cache (`KVCache(int8=True)`), dequantised as it is read; `[n, KVH, G, D]`."""
        n, kv_heads, group, head_dim = self._geometry(q)
        if k_slots.dtype != torch.int8 or k_scales.dtype != torch.float32 or q.dtype not in (torch.bfloat16,
                                                                                             torch.float32):
            raise ValueError("int8 paged decode needs int8 caches, fp32 scales and bf16 or fp32 queries")
        if not all(t.is_contiguous() for t in (k_slots, v_slots, k_scales, v_scales, tables)):
            raise ValueError("int8 paged decode needs contiguous caches, scales and block tables")
        q = q.contiguous()
        out = torch.empty_like(q)
        heads = kv_heads * group
        scratch = torch.empty(n * (heads * max_length + heads * head_dim), dtype=torch.float32)
        status = self._decode_i8(
            q.data_ptr(), int(q.dtype == torch.bfloat16), k_slots.data_ptr(), v_slots.data_ptr(), k_scales.data_ptr(),
            v_scales.data_ptr(), tables.data_ptr(), tables.shape[1], lengths.data_ptr(), n, kv_heads, group, head_dim,
            block_size, max_length, scale, scratch.data_ptr(), out.data_ptr(),
        )
        if status != 0:
            raise ValueError("int8 paged decode refused its geometry")  # checked above
        return out

    def prefill(
        self,
        q: torch.Tensor,  # [t, H, D] fp32 or bf16: the chunk's queries, at positions start .. start + t - 1
        k_source: torch.Tensor,  # [slots, KVH, D], q's dtype, contiguous: the cache, or the chunk's own keys
        v_source: torch.Tensor,
        table: torch.Tensor | None,  # [blocks] int64: the sequence's blocks in k_source; None: row j is key j
        block_size: int,
        start: int,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of one prefill chunk over keys 0 .. start + t - 1; returns `[t, H, D]`.

        The caller guarantees that the table covers the chunk's keys (the runner builds it)."""
        t, heads, head_dim = q.shape
        kv_heads = k_source.shape[1]
        if (head_dim, heads // kv_heads) != (self.head_dim, self.group):
            raise ValueError(f"prefill kernel built for head_dim {self.head_dim}, group {self.group}")
        if not (q.dtype == k_source.dtype == v_source.dtype and q.dtype in self.prefill_dtypes):
            raise ValueError(f"paged prefill here takes {sorted(map(str, self.prefill_dtypes))} queries and keys, "
                             f"got {q.dtype}, {k_source.dtype}")
        if not (k_source.is_contiguous() and v_source.is_contiguous()):
            raise ValueError("paged prefill needs contiguous key and value rows")
        if table is not None and not table.is_contiguous():
            raise ValueError("paged prefill needs a contiguous block table")
        q = q.contiguous()
        out = torch.empty_like(q)
        status = self._prefill[q.dtype](
            q.data_ptr(), k_source.data_ptr(), v_source.data_ptr(), None if table is None else table.data_ptr(),
            block_size, start, t, kv_heads, self.group, head_dim, scale, out.data_ptr(),
        )
        if status != 0:
            raise MemoryError("paged prefill: out of memory")  # the geometry was checked above
        return out

    def prefill_int8(
        self,
        q: torch.Tensor,  # [t, H, D] bf16 or fp32: the chunk's queries, at positions start .. start + t - 1
        k_slots: torch.Tensor,  # [num_slots, KVH, D] int8, contiguous: the cache
        v_slots: torch.Tensor,
        k_scales: torch.Tensor,  # [num_slots, KVH] fp32, contiguous
        v_scales: torch.Tensor,
        table: torch.Tensor,  # [blocks] int64: the sequence's blocks
        block_size: int,
        start: int,
        scale: float,
    ) -> torch.Tensor:
        """`prefill` over an int8 cache (the fp32 kernel, dequantising as it packs); `[t, H, D]` in q's dtype."""
        t, heads, head_dim = q.shape
        kv_heads = k_slots.shape[1]
        if (head_dim, heads // kv_heads) != (self.head_dim, self.group) or torch.float32 not in self.prefill_dtypes:
            raise ValueError(f"prefill kernel built for head_dim {self.head_dim}, group {self.group}")
        if k_slots.dtype != torch.int8 or k_scales.dtype != torch.float32:
            raise ValueError("int8 paged prefill needs int8 caches and fp32 scales")
        if not all(x.is_contiguous() for x in (k_slots, v_slots, k_scales, v_scales, table)):
            raise ValueError("int8 paged prefill needs contiguous caches, scales and block table")
        q32 = q.float().contiguous()
        out = torch.empty_like(q32)
        status = self._prefill_i8(
            q32.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(), k_scales.data_ptr(), v_scales.data_ptr(),
            table.data_ptr(), block_size, start, t, kv_heads, self.group, head_dim, scale, out.data_ptr(),
        )
        if status != 0:
            raise MemoryError("int8 paged prefill: out of memory")  # the geometry was checked above
        return out.to(q.dtype)

    def causal_softmax_(self, scores: torch.Tensor, rows: int, first_pos: int, scale: float) -> torch.Tensor:
        """In place on bf16 `scores [heads * rows, seen]` (any leading shape): scale, causal mask from
        `first_pos`, softmax in fp32, rounded back; returns `scores` (now probabilities)."""
        if scores.dtype != torch.bfloat16 or not scores.is_contiguous():
            raise ValueError("causal_softmax_ needs contiguous bf16 scores")
        seen = scores.shape[-1]
        if self._softmax(scores.data_ptr(), scores.numel() // (rows * seen), rows, seen, first_pos, scale) != 0:
            raise MemoryError("causal_softmax_: out of memory")
        return scores

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Llama-family RMSNorm of bf16 or fp32 `x [..., width]` (contiguous) with a `weight [width]` of x's dtype."""
        width = x.shape[-1]
        if x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype or not x.is_contiguous():
            raise ValueError("rms_norm needs contiguous bf16 or fp32 input and a weight of its dtype")
        if weight.shape != (width,) or not weight.is_contiguous():
            raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of {width}")
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), x.dtype == torch.bfloat16, weight.data_ptr(), x.numel() // width, width, eps,
                       out.data_ptr())
        return out

    def write_kv(self, k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor, k_new: torch.Tensor,
                 v_new: torch.Tensor) -> bool:
        """`k_slots[slots] = k_new` and the same for values, for contiguous caches `[num_slots, KVH, D]` and
        rows `[T, KVH, D]` whose heads are contiguous (views of a QKV projection); False (nothing written)
        where the layouts differ. The caller guarantees that `slots` index the cache (the runner builds them)."""
        rows = k_new.shape[0]
        row = k_slots[0].numel()
        if not (k_new.dtype == v_new.dtype == k_slots.dtype == v_slots.dtype and k_slots.is_contiguous()
                and v_slots.is_contiguous() and slots.dtype == torch.int64 and slots.is_contiguous()
                and slots.shape == (rows,) and k_new.shape == v_new.shape == (rows, *k_slots.shape[1:])
                and k_new[0].is_contiguous() and v_new[0].is_contiguous()):
            return False
        size = k_new.element_size()
        self._write_kv(k_new.data_ptr(), v_new.data_ptr(), rows, k_new.stride(0) * size, v_new.stride(0) * size,
                       row * size, slots.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr())
        return True

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of a gated MLP's contiguous bf16 or fp32 `gate_up [rows, 2 * inter]`: `[rows, inter]`."""
        rows, width = gate_up.shape
        if gate_up.dtype not in (torch.bfloat16, torch.float32) or not gate_up.is_contiguous() or width % 2:
            raise ValueError(f"silu_mul needs contiguous bf16 or fp32 rows of even width, got {gate_up.dtype} "
                             f"{tuple(gate_up.shape)}")
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), gate_up.dtype == torch.bfloat16, rows, width // 2, out.data_ptr())
        return out

    def head_rms_norm_(self, rows: torch.Tensor, heads: int, weight: torch.Tensor, eps: float) -> None:
        """RMSNorm in place over each of the first `heads` heads of bf16 or fp32 `rows [n, >= heads * head_dim]`
        (each row contiguous; a slice of a QKV projection), with a `weight [head_dim]` of their dtype: Qwen3's
        Q and K norms."""
        n, width = rows.shape
        if rows.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != rows.dtype or rows.stride(1) != 1:
            raise ValueError("head_rms_norm_ needs bf16 or fp32 rows and a weight of their dtype")
        if heads * self.head_dim > width or weight.shape != (self.head_dim,) or not weight.is_contiguous():
            raise ValueError(f"head_rms_norm_: {heads} heads of {self.head_dim} in rows of {width}, weight of "
                             f"shape {tuple(weight.shape)}")
        self._head_rms_norm(rows.data_ptr(), rows.dtype == torch.bfloat16, n, rows.stride(0), heads,
                            weight.data_ptr(), eps)

    def rope_(self, qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """RoPE in place on the first `heads` heads of bf16 or fp32 `qkv [rows, >= heads * head_dim]` (rows
        contiguous), with `cos`, `sin` `[rows, head_dim]` of its dtype."""
        rows, width = qkv.shape
        ok = qkv.dtype in (torch.bfloat16, torch.float32) and qkv.dtype == cos.dtype == sin.dtype and qkv.stride(1) == 1
        if not ok or heads * self.head_dim > width or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rope_ needs bf16 or fp32 rows of at least `heads` heads and contiguous cos, sin "
                             "of their dtype")
        if cos.shape != (rows, self.head_dim) or sin.shape != cos.shape:
            raise ValueError(f"rope_: cos, sin of shape {tuple(cos.shape)} for {rows} rows of head_dim {self.head_dim}")
        self._rope(qkv.data_ptr(), qkv.dtype == torch.bfloat16, rows, qkv.stride(0), heads, cos.data_ptr(),
                   sin.data_ptr())


def _build_key(compiler: str, flags: tuple[str, ...], source: Path = SOURCE) -> str:
    """Hash of what the library depends on: source and the files it may include beside it (headers, and the
    parts `cpu_kernels.c` includes), flags, compiler version, CPU features."""
    digest = hashlib.sha256(source.read_bytes())
    for part in sorted([*source.parent.glob("*.h"), *source.parent.glob("*.c")]):
        digest.update(part.read_bytes())
    digest.update(" ".join((*flags, *LINK_FLAGS)).encode())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest.update(version.encode())
    digest.update(platform.machine().encode())
    digest.update((" ".join(sorted(cpu_flags())) or platform.processor()).encode())
    return digest.hexdigest()[:16]


def build_library(compiler: str, folder: Path, source: Path, stem: str, flags: tuple[str, ...], title: str) -> Path:
    """Compile `source` into `folder/<stem>-<key>.so` once (a build with the same key is reused)."""
    target = folder / f"{stem}-{_build_key(compiler, flags, source)}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    obj = tmp[: -len(".so.tmp")] + ".o"
    steps = {"compile": [compiler, *flags, "-c", "-o", obj, str(source)],
             "link": [compiler, *LINK_FLAGS, "-o", tmp, obj, "-lm"]}
    try:
        with StageBar(title, tuple(steps)) as bar:
            for name, command in steps.items():
                with bar.stage(name):
                    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    raise OSError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each write their own temporary file
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


def load_library(source: Path, stem: str, flags: tuple[str, ...], title: str) -> tuple[ctypes.CDLL, Path] | None:
    """Build (once) and load a kernel library, or None (logged) where it cannot be built or would bring
    its own OpenMP runtime."""
    loaded_gomp = loaded_libgomp_paths()
    # The runtime the library's libgomp.so.1 dependency binds to: the one loaded under that name (torch's).
    # Copies vendored under other names (sentencepiece's wheel maps one as soon as a tokenizer imports it)
    # bind to no one else, so they do not count.
    torch_gomp = {path for path in loaded_gomp if Path(path).name == "libgomp.so.1"}
    if len(torch_gomp) != 1:
        log.info("native kernels off: torch does not use libgomp here (%s)", sorted(loaded_gomp) or "none")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("native kernels off: no C compiler (set CC)")
        return None
    try:
        path = build_library(compiler, tokenflow_home() / "kernels", source, stem, flags, title)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native kernels off: %s", e)
        return None
    if loaded_libgomp_paths() != loaded_gomp:  # loaded, but bound to a second OpenMP runtime: leave it unused
        log.warning("native kernels off: the kernel loaded a second OpenMP runtime")
        return None
    log.info("native kernels: %s", path)
    return library, path


@functools.cache
def load_native_kernels(head_dim: int, group: int) -> NativeKernels | None:
    """The library built for this head geometry, or None (see `load_library`)."""
    flags = (*FLAGS, f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}")
    loaded = load_library(SOURCE, f"cpu_kernels-d{head_dim}g{group}", flags,
                          f"tokenflow: building CPU kernels for head size {head_dim}")
    return None if loaded is None else NativeKernels(*loaded, head_dim, group)

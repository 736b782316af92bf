"""drop_resident_pages: the pages of a memory-mapped checkpoint's tensors leave the process's RSS, the file's
contents stay readable (they fault back in from it)."""

from __future__ import annotations

import sys

import pytest
import torch

from tokenflow.runtime.cpu.resident_pages import drop_resident_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")


def resident_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile"))


def test_a_mapped_tensors_pages_leave_the_process(tmp_path) -> None:
    size = 64 * 2**20
    path = tmp_path / "weights.bin"
    values = torch.arange(size // 4, dtype=torch.int32)
    path.write_bytes(values.numpy().tobytes())
    mapped = torch.from_file(str(path), shared=True, size=size // 4, dtype=torch.int32)  # the file's pages
    assert torch.equal(mapped, values)  # every page read: resident
    before = resident_file_kib()
    head, tail = mapped[:1000], mapped[1000:]  # a tensor sharing the first page stays resident
    assert drop_resident_pages([tail]) > size - 2 * 4096
    after = resident_file_kib()
    assert before - after > 0.9 * size / 1024, (before, after)
    assert torch.equal(mapped, values) and int(head.sum()) == sum(range(1000))  # read again from the file
    assert drop_resident_pages([torch.empty(0)]) == 0

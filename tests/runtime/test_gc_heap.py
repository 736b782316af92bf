"""`freeze_gc`: objects alive when an engine started are out of the collector's scans until it closes."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from tokenflow import Engine
from tokenflow.runtime import gc_heap


class Node:
    """A reference cycle only the cyclic collector frees."""

    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("freeze", [True, False])
async def test_a_started_engine_freezes_the_heap_until_it_closes(tiny_model: Path, freeze: bool) -> None:
    assert gc_heap._holders == 0  # no other engine holds the heap in this test
    frozen_before = gc.get_freeze_count()
    node = Node()
    alive = weakref.ref(node)
    async with Engine(tiny_model, dtype="float32", freeze_gc=freeze) as engine:
        assert (gc.get_freeze_count() > frozen_before) is freeze
        del node  # garbage from here on: a cycle, so only a collection frees it
        gc.collect()
        assert (alive() is not None) is freeze  # frozen: full collections skip it
        completion = await engine.generate([5, 6, 7], max_tokens=3, temperature=0.0)
        assert len(completion.token_ids) == 3
    assert gc_heap._holders == 0 and gc.get_freeze_count() == frozen_before * (not freeze)
    gc.collect()
    assert alive() is None  # unfrozen at close: collected

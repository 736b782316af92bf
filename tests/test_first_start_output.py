"""What the Python API prints at an engine's first start: bars on a terminal, nothing in a pipe, and no
third-party noise either way (torchao's missing CUDA libraries, torch's pytree deprecation)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tokenflow.noise import NOISE

SCRIPT = """
import anyio, tokenflow

async def main():
    async with tokenflow.Engine({model!r}, max_num_seqs=2) as engine:
        done = await engine.generate("hello", max_tokens=3, ignore_eos=True)
        print("TOKENS", len(done.token_ids))

anyio.run(main)
"""


def _run(model: Path, home: Path, *, on_terminal: bool) -> str:
    """The script in a fresh interpreter and a fresh TOKENFLOW_HOME; stdout and stderr together."""
    env = {**os.environ, "TOKENFLOW_HOME": str(home)}
    argv = [sys.executable, "-c", SCRIPT.format(model=str(model))]
    if not on_terminal:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=True)
        return done.stderr + done.stdout
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a real terminal's size
    process = subprocess.Popen(argv, env=env, stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    out = b""
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        out += data
    os.close(leader)
    assert process.wait(timeout=600) == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


def _noise_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(f in line for fragments in NOISE.values() for f in fragments)]


@pytest.mark.slow  # builds the C kernels twice, in two fresh homes
def test_first_start_draws_bars_on_a_terminal_and_stays_quiet_in_a_pipe(tiny_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("torchao")  # the noise comes from torchao being installed (the cuda-int8 extra)
    terminal = _run(tiny_model, tmp_path / "home-terminal", on_terminal=True)
    assert "TOKENS 3" in terminal
    assert "tokenflow: building CPU kernels" in terminal and "2/2 stages |" in terminal, terminal
    assert _noise_in(terminal) == []

    piped = _run(tiny_model, tmp_path / "home-pipe", on_terminal=False)
    assert "TOKENS 3" in piped
    assert "building" not in piped and "stages" not in piped, piped  # no logging configured: nothing
    assert _noise_in(piped) == []
    assert list((tmp_path / "home-pipe" / "kernels").iterdir()), "the pipe run built its kernels too, silently"


def test_the_filters_drop_only_the_noise() -> None:
    """The same loggers still pass their other warnings."""
    import logging

    from tokenflow.noise import filter_third_party_noise

    filter_third_party_noise()
    filter_third_party_noise()  # once per logger, however often engines start
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    for name in NOISE:
        logger = logging.getLogger(name)
        assert sum(type(f).__name__ == "_DropMatching" for f in logger.filters) == 1
        logger.addHandler(handler)
    try:
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_cutlass_90a.abi3.so: nope")
        logging.getLogger("torchao").warning("a real torchao warning")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile", "<enum 'X'>")
        logging.getLogger("torch.utils._pytree").warning("another pytree warning")
    finally:
        for name in NOISE:
            logging.getLogger(name).removeHandler(handler)
    assert seen == ["a real torchao warning", "another pytree warning"]

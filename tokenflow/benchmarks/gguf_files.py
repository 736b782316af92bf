"""GGUF files of a bench's model for llama.cpp, made with llama.cpp's own tools.

`scripts/peers.sh llamacpp` builds `llama-server`, `llama-quantize` and `llama-perplexity` from the
`vendor/llama.cpp` tree of the llama-cpp-python sdist into `.peers/llamacpp` and keeps the tree beside them.
The GGUF of a model folder is made by that tree's `convert_hf_to_gguf.py` (bf16, f32, q8_0) and, for the
k-quants, `llama-quantize` from the bf16 file, as a llama.cpp user makes them; files are cached in the model
cache, keyed by the folder's weights.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

__all__ = ("GGUF_QUANT_TYPES", "GGUF_TYPES", "gguf_for", "gguf_of_model", "llamacpp_binary")

# the bench's dtype (or a GGUF type) -> the converter's --outtype, or the llama-quantize type
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32", "bf16": "bf16", "f32": "f32", "q8_0": "q8_0",
              "q4_k_m": "Q4_K_M", "q6_k": "Q6_K", "q4_0": "Q4_0"}
_CONVERTER_TYPES = {"bf16", "f32", "q8_0"}
# the quantised ones: tokenflow runs the file too
GGUF_QUANT_TYPES = frozenset(kind for kind, gguf_type in GGUF_TYPES.items() if gguf_type not in ("bf16", "f32"))


def _peer_dir() -> Path:
    return Path.cwd() / ".peers" / "llamacpp"  # as the vLLM peer's venv: the bench runs from the checkout


def llamacpp_binary(name: str) -> str:
    """The path of llama.cpp's `name` (llama-server, llama-quantize, llama-perplexity): `$LLAMACPP_SERVER`'s
    folder where it is set, else `.peers/llamacpp/bin`."""
    server = os.environ.get("LLAMACPP_SERVER")
    folder = Path(server).parent if server else _peer_dir() / "bin"
    path = Path(server) if server and name == "llama-server" else folder / name
    if not path.is_file():
        raise SystemExit(f"no {name} at {path}: run scripts/peers.sh llamacpp (or set LLAMACPP_SERVER)")
    return str(path)


def _tree() -> Path:
    tree = Path(os.environ.get("LLAMACPP_SOURCE", _peer_dir() / "src"))
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"no llama.cpp tree at {tree}: run scripts/peers.sh llamacpp (or set LLAMACPP_SOURCE)")
    return tree


def _weights_key(folder: Path) -> str:
    digest = hashlib.sha256(str(folder.resolve()).encode())
    for path in [*sorted(folder.glob("*.safetensors")), folder / "config.json"]:
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def gguf_for(folder: Path, kind: str) -> Path:
    """The GGUF file of the model in `folder` of type `kind` (a key of GGUF_TYPES), made once."""
    from tokenflow.hub.cache import ensure_folder, models_root

    gguf_type = GGUF_TYPES.get(kind.lower())
    if gguf_type is None:
        raise SystemExit(f"no GGUF type for {kind!r}; known: {', '.join(sorted(GGUF_TYPES))}")
    key = _weights_key(folder)
    dest = models_root() / "gguf" / f"{folder.name}-{key}-{gguf_type.lower()}"

    def build(tmp: Path) -> None:
        out = tmp / "model.gguf"
        if gguf_type in _CONVERTER_TYPES:
            tree = _tree()
            _run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out),
                  "--outtype", gguf_type], env={**os.environ, "PYTHONPATH": str(tree / "gguf-py")})
        else:
            _run([llamacpp_binary("llama-quantize"), str(gguf_for(folder, "bf16")), str(out), gguf_type])

    return ensure_folder(dest, key, build, meta={"gguf_type": gguf_type}) / "model.gguf"


def gguf_of_model(model: str | None, kind: str) -> Path:
    """`gguf_for` of what `model` resolves to (an alias, a folder, None: the embedded model)."""
    from tokenflow.hub import resolve_model

    return gguf_for(resolve_model(model).path, kind)


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """`cmd`, quiet unless it fails (then its output's end and the command)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{(proc.stdout + proc.stderr)[-3000:]}\nfailed (exit {proc.returncode}): {' '.join(cmd)}")

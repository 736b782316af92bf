"""Tokenizers for the text tests: the real embedded model's (byte-level BPE) and
small hand-built SentencePiece-style ones that exercise the window strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers


@pytest.fixture(scope="session")
def real_tokenizer(real_model: Path) -> Any:
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, vocab 49152) as transformers loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model)


_CHARS = "▁abcdefghijklmnopqrstuvwxyz.,!?'你好"
_MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("▁", "你"), ("你", "好"), ("▁", "▁")]


def _vocab(byte_tokens: bool) -> dict[str, int]:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    if byte_tokens:
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in _CHARS:
        vocab.setdefault(c, len(vocab))
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    return vocab


def _with_specials(tok: Tokenizer) -> Tokenizer:
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


@pytest.fixture(scope="session")
def llama_like_tokenizer() -> Tokenizer:
    """Llama-2 style: BPE with byte fallback, "▁" for spaces, decoder strips one leading space."""
    tok = Tokenizer(models.BPE(_vocab(True), _MERGES, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _with_specials(tok)


@pytest.fixture(scope="session")
def metaspace_tokenizer() -> Tokenizer:
    """Metaspace pre-tokenizer and decoder (prepend_scheme="first"), no byte fallback."""
    tok = Tokenizer(models.BPE(_vocab(False), _MERGES, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return _with_specials(tok)


@pytest.fixture(scope="session")
def wordpiece_tokenizer() -> Tokenizer:
    """BERT-style WordPiece: "##" continuations, decoder joins with spaces and cleans up " ." etc."""
    words = [
        "the",
        "cat",
        "##s",
        "##ing",
        ".",
        ",",
        "'",
        "s",
        "t",
        "n",
        "##n",
        "do",
        "!",
        "?",
        "a",
        "##t",
        "你",
    ]
    tok = Tokenizer(
        models.WordPiece({w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=True)
    return _with_specials(tok)

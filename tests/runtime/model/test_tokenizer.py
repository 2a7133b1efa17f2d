"""Tokenizers: the checkpoint's tokenizer.json through `tokenizers`, else the byte-level fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")


def test_byte_fallback_round_trips_utf8(tmp_path: Path) -> None:
    tok = load_tokenizer(tmp_path, vocab_size=512)
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("héllo ✓")
    assert ids[0] == tok.bos_id == 256 and tok.eos_id == 257 and max(ids[1:]) < 256
    assert tok.decode(ids + [tok.eos_id, 400]) == "héllo ✓"
    assert tok.encode("a", add_bos=False) == [97]
    with pytest.raises(ValueError, match="vocab_size >= 258.*got 64"):
        ByteTokenizer(64)


def test_tokenizer_json_is_used_when_present(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    loaded = load_tokenizer(tmp_path, vocab_size=5)
    assert isinstance(loaded, HFTokenizer)
    assert (loaded.bos_id, loaded.eos_id) == (0, 1)
    assert loaded.encode("hello world nope") == [0, 2, 3, 4]
    assert loaded.decode([0, 2, 3, 1]) == "hello world"

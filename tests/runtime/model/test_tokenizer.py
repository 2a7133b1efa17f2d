"""Tokenizers: the checkpoint's tokenizer.json through `tokenizers`, else the byte-level fallback."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from adapter_manager.runtime.model.config import LlamaConfig
from adapter_manager.runtime.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    write_byte_level_tokenizer,
)

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
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(tmp_path, vocab_size=5)
    assert isinstance(loaded, HFTokenizer)
    assert (loaded.bos_id, loaded.eos_id) == (0, 1)
    assert loaded.encode("hello world nope") == [0, 2, 3, 4]  # add_bos_token: the config asks for BOS
    assert loaded.decode([0, 2, 3, 1]) == "hello world"


@pytest.mark.parametrize("template", [None, "<s> $A"], ids=["no-bos (SmolLM2)", "bos (Llama 3)"])
def test_a_texts_specials_are_the_tokenizers_own_as_in_transformers(tmp_path: Path, template: str | None) -> None:
    """A bos_token named in the config is not a reason to add it: the tokenizer.json post-processor decides, as
    transformers' tokenizer (and so vLLM) does. Chat templates carry their own specials (add_bos=False)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ours = load_tokenizer(tmp_path, vocab_size=5)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("hello world", "world", "nope hello"):
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text, add_bos=False) == theirs(text, add_special_tokens=False)["input_ids"], text
    assert ours.encode("hello")[0] == (0 if template else 2)


def test_add_bos_and_eos_token_flags_of_the_config_decide_where_set(tmp_path: Path) -> None:
    """tokenizer_config.json's add_bos_token / add_eos_token (Llama's tokenizers) win over the post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    flags = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "add_eos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(flags))
    assert load_tokenizer(tmp_path, vocab_size=4).encode("hi hi") == [2, 2, 1]


def test_byte_fallback_gives_exact_token_bytes_and_never_writes_the_models_specials(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    tok = load_tokenizer(tmp_path, vocab_size=512)
    assert tok.special_ids == {1, 2, 3}
    assert tok.decode([72, 2, 105, 1, 3, tok.eos_id]) == "Hi"  # the model's eos (2) is no "\x02"
    assert [tok.token_bytes(i) for i in (0xE2, 0x9C, 0x93)] == [b"\xe2", b"\x9c", b"\x93"]  # "✓", byte by byte
    assert tok.token_text(0xE2) == "\ufffd" and tok.token_text(65) == "A"  # alone, as vLLM shows it
    for special in (1, 2, 256, 257, 400):  # no name in a byte vocabulary: "" (vLLM's text for a nameless id)
        assert tok.token_text(special) == "" and tok.token_bytes(special) == b""
    with pytest.raises(ValueError, match=r"special_ids .*\[600\].*vocab_size 512"):
        ByteTokenizer(512, frozenset({600}))


def _saved(tok, folder: Path, bos: str, eos: str) -> HFTokenizer:
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    return HFTokenizer(folder)


def test_byte_level_bpe_token_bytes_undo_gpt2s_byte_alphabet(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world", "hello there"] * 20, trainer)
    loaded = _saved(tok, tmp_path, "<|endoftext|>", "<|endoftext|>")
    text = "hello ✓ wörld"
    ids = loaded.encode(text, add_bos=False)
    assert b"".join(loaded.token_bytes(i) for i in ids) == text.encode("utf-8")
    check = tok.token_to_id("â")  # byte 0xE2 in GPT-2's alphabet: the lead byte of "✓"
    assert loaded.token_bytes(check) == b"\xe2" and loaded.token_text(check) == "\ufffd"
    assert loaded.token_bytes(tok.token_to_id("Ġ")) == b" "
    eos = loaded.eos_id
    assert loaded.token_text(eos) == "<|endoftext|>" and loaded.decode([*ids, eos]) == text  # vLLM: its name


def test_byte_fallback_bpe_token_bytes_read_the_byte_tokens(tmp_path: Path) -> None:
    """A Llama 2 / Mistral style tokenizer.json: SentencePiece BPE, "▁" for spaces, <0xNN> byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "h", "i", "▁h", "▁hi"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    loaded = _saved(tok, tmp_path, "<s>", "</s>")
    ids = loaded.encode("hi ✓", add_bos=False)
    assert ids == [vocab["▁hi"], vocab["▁"], vocab["<0xE2>"], vocab["<0x9C>"], vocab["<0x93>"]]
    assert [loaded.token_bytes(i) for i in ids] == [b" hi", b" ", b"\xe2", b"\x9c", b"\x93"]
    assert loaded.token_text(vocab["<0xE2>"]) == "\ufffd" and loaded.token_text(vocab["▁hi"]) == " hi"
    assert loaded.decode([1, *ids, 2]) == "hi ✓" and loaded.token_text(2) == "</s>"


def test_other_tokenizer_json_models_give_their_texts_bytes(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "héllo": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    loaded = _saved(tok, tmp_path, "<s>", "</s>")
    assert loaded.token_bytes(2) == "héllo".encode() and loaded.token_text(2) == "héllo"
    assert loaded.token_text(1) == "</s>" and loaded.token_bytes(1) == b"</s>"


def test_the_byte_fallback_says_at_load_which_bytes_cannot_round_trip(tmp_path: Path, caplog) -> None:
    """A checkpoint whose BOS / EOS ids (1, 2) are byte ids: the bytes 0x01 / 0x02 encode to its specials and vanish
    on decode; load says so once, naming them, and every other byte still round-trips."""
    import logging

    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    with caplog.at_level(logging.WARNING, logger="adapter_manager.runtime.model.tokenizer"):
        tok = load_tokenizer(tmp_path, vocab_size=300)
    assert "0x01, 0x02" in caplog.text and "no round trip" in caplog.text
    assert tok.decode(tok.encode("a\x01b\x03", add_bos=False)) == "ab\x03"
    caplog.clear()
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
    with caplog.at_level(logging.WARNING, logger="adapter_manager.runtime.model.tokenizer"):
        load_tokenizer(tmp_path, vocab_size=300)
    assert caplog.text == ""


@pytest.mark.parametrize("size", ["tiny", "bench"])
def test_a_random_models_tokenizer_round_trips_text_over_exactly_its_vocabulary(tmp_path: Path, size: str) -> None:
    """The demo's and `serve --random`'s model carries a byte-level BPE of its own: every id below vocab_size is a
    piece, its BOS / EOS ids are <s> / </s>, any text round-trips, and transformers reads it the same way."""
    config = getattr(LlamaConfig, size)()
    start = time.perf_counter()
    write_byte_level_tokenizer(tmp_path / "a", config)
    assert time.perf_counter() - start < 1.0
    write_byte_level_tokenizer(tmp_path / "b", config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    tok = load_tokenizer(tmp_path / "a", config.vocab_size)
    assert isinstance(tok, HFTokenizer) and (tok.bos_id, tok.eos_id) == (1, 2)
    saved = tokenizers.Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    assert saved.get_vocab_size() == config.vocab_size == len(set(saved.get_vocab().values()))
    text = "Request 7: a short note on tea.\n\théllo ✓ \x01\x02"
    ids = tok.encode(text)
    assert ids[0] == 1 and 2 not in ids and max(ids) < config.vocab_size and len(ids) < len(text.encode())
    assert tok.decode([*ids, 2]) == text  # bytes 0x01 / 0x02 are no specials here
    assert b"".join(tok.token_bytes(i) for i in ids[1:]) == text.encode()
    assert tok.token_text(1) == "<s>" and tok.token_text(2) == "</s>"
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
    assert theirs(text)["input_ids"] == ids and len(theirs) == config.vocab_size
    assert theirs.decode(ids, skip_special_tokens=True) == text


def test_a_random_models_tokenizer_needs_room_for_the_bytes(tmp_path: Path) -> None:
    small = LlamaConfig(vocab_size=64)
    with pytest.raises(ValueError, match=r"vocab_size \(64\) >= 256 bytes \+ 2 special ids"):
        write_byte_level_tokenizer(tmp_path, small)
    outside = LlamaConfig(vocab_size=512, eos_token_ids=(600,))
    with pytest.raises(ValueError, match=r"outside: \[600\]"):
        write_byte_level_tokenizer(tmp_path, outside)

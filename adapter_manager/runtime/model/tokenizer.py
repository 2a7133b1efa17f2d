"""Text <-> token ids: the checkpoint's ``tokenizer.json`` through `tokenizers`, or a byte-level fallback.

Both also give one token as logprobs show it: its text decoded alone (a special token's name, as vLLM's logprobs
show it) and its exact UTF-8 bytes (OpenAI's ``bytes``: a byte token's one byte, where its text alone is U+FFFD).
A random-weight model gets a ``tokenizer.json`` of its own from :func:`write_byte_level_tokenizer`."""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .checkpoint import CONFIG_FILE, GENERATION_CONFIG_FILE
from .config import LlamaConfig, eos_ids

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_BYTES = 256
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback vocabulary's byte tokens
_FREQUENT = b" etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789.,'-:;!?()\"\n"  # merged first


class Tokenizer(Protocol):
    """What the engine and CLI need from a tokenizer."""

    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; special ids are no text."""
        ...

    def token_text(self, token_id: int) -> str:
        """The token decoded alone (U+FFFD for part of a character); a special token's name, or "" if it has none."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The token's exact UTF-8 bytes (part of a character included); a special token's those of its name."""
        ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS = 256 and EOS = 257: for random-weight demo models without a tokenizer.

    Needs vocab_size >= 258; ids the bytes cannot be (>= 258) and the model's own special ids decode to nothing.
    """

    vocab_size: int
    """The model's vocabulary; must hold the 256 bytes and the two specials."""
    special_ids: frozenset[int] = field(default_factory=frozenset)
    """The model's own special ids (its config's BOS / EOS, e.g. 1 and 2): no text even where they are byte ids."""

    def __post_init__(self) -> None:
        if self.vocab_size < _BYTES + 2:
            raise ValueError(
                f"the byte tokenizer needs vocab_size >= {_BYTES + 2} (bytes + BOS/EOS), got {self.vocab_size}"
            )
        outside = sorted(i for i in self.special_ids if not 0 <= i < self.vocab_size)
        if outside:
            raise ValueError(f"special_ids {outside} fall outside vocab_size {self.vocab_size}")

    @property
    def bos_id(self) -> int:
        return _BYTES

    @property
    def eos_id(self) -> int:
        return _BYTES + 1

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < _BYTES and token_id not in self.special_ids else b""


class HFTokenizer:
    """A ``tokenizer.json`` (fast tokenizer) read with the `tokenizers` library; BOS/EOS from tokenizer_config.json.

    A text's special tokens are the tokenizer's own, as transformers and vLLM add them: ``add_bos_token`` /
    ``add_eos_token`` where tokenizer_config.json sets them (Llama's tokenizers), else the ``tokenizer.json``
    post-processor (Llama 3's adds ``<|begin_of_text|>``; SmolLM2's adds nothing)."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        folder = Path(folder)
        self._tokenizer = FastTokenizer.from_file(str(folder / TOKENIZER_FILE))
        self._added = frozenset(self._tokenizer.get_added_tokens_decoder())
        self._pieces = _PieceBytes.of(json.loads(self._tokenizer.to_str()))
        special = _special_tokens(folder)
        self.bos_id = self._id(special.get("bos_token"))
        self.eos_id = self._id(special.get("eos_token"))
        flags = dict(_fields(folder, (TOKENIZER_CONFIG_FILE,), ("add_bos_token", "add_eos_token")))
        self._add_bos: bool | None = flags.get("add_bos_token")
        self._add_eos: bool = bool(flags.get("add_eos_token", False))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """``text``'s ids with the special tokens the tokenizer adds to a text (``add_bos``; False: none, for a text
        whose template carries its own)."""
        if not add_bos:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        if self._add_bos is None:  # the tokenizer.json's own post-processor decides
            return self._tokenizer.encode(text, add_special_tokens=True).ids
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        bos = [self.bos_id] if self._add_bos and self.bos_id is not None else []
        eos = [self.eos_id] if self._add_eos and self.eos_id is not None else []
        return [*bos, *ids, *eos]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        exact = self._piece_bytes(token_id)
        if exact is None:  # added tokens (specials by their names, as vLLM), unknown ids, other decoders
            return self._tokenizer.decode([token_id], skip_special_tokens=False)
        return exact.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        exact = self._piece_bytes(token_id)
        return self.token_text(token_id).encode("utf-8") if exact is None else exact

    def _piece_bytes(self, token_id: int) -> bytes | None:
        """The vocabulary piece's bytes where the decoder's mapping of pieces is known, else None."""
        piece = None if token_id in self._added else self._tokenizer.id_to_token(token_id)
        return None if piece is None or self._pieces is None else self._pieces(piece)


@dataclass(frozen=True)
class _PieceBytes:
    """A vocabulary piece's exact bytes, by what a ``tokenizer.json``'s decoder does to each piece: GPT-2's byte
    alphabet (ByteLevel), ``<0xNN>`` byte tokens (ByteFallback), replacements such as "▁" -> " " (Replace,
    Metaspace). A piece's leading space is kept (the decoder strips it only at a text's start)."""

    alphabet: dict[str, int]  # ByteLevel: the printable character standing for each byte -> that byte; else empty
    byte_tokens: bool
    replacements: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, saved: dict[str, Any]) -> _PieceBytes | None:
        """From the parsed ``tokenizer.json``; None for decoders mapping pieces otherwise (WordPiece, none)."""
        decoder = saved.get("decoder") or {}
        steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        kinds = {step.get("type") for step in steps}
        byte_tokens = "ByteFallback" in kinds or bool((saved.get("model") or {}).get("byte_fallback"))
        replacements = tuple(
            (step["pattern"]["String"], step["content"])
            for step in steps
            if step.get("type") == "Replace" and "String" in step.get("pattern", {})
        ) + tuple((step["replacement"], " ") for step in steps if step.get("type") == "Metaspace")
        if "ByteLevel" not in kinds and not byte_tokens and not replacements:
            return None
        return cls(_gpt2_alphabet() if "ByteLevel" in kinds else {}, byte_tokens, replacements)

    def __call__(self, piece: str) -> bytes:
        if self.alphabet and all(c in self.alphabet for c in piece):
            return bytes(self.alphabet[c] for c in piece)
        byte = _BYTE_TOKEN.fullmatch(piece) if self.byte_tokens else None
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        for old, new in self.replacements:
            piece = piece.replace(old, new)
        return piece.encode("utf-8")


def _gpt2_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(_BYTES) if b not in printable]
    return {chr(b): b for b in printable} | {chr(_BYTES + n): b for n, b in enumerate(others)}


def load_tokenizer(folder: str | Path, vocab_size: int) -> Tokenizer:
    """The checkpoint's ``tokenizer.json`` if it has one, else :class:`ByteTokenizer` over ``vocab_size`` with the
    checkpoint's BOS / EOS ids as its special ids."""
    folder = Path(folder)
    if (folder / TOKENIZER_FILE).is_file():
        return HFTokenizer(folder)
    ids = _fields(folder, (CONFIG_FILE, GENERATION_CONFIG_FILE), ("bos_token_id", "eos_token_id"))
    tokenizer = ByteTokenizer(vocab_size, frozenset(i for _, value in ids for i in eos_ids(value)))
    shared = sorted(i for i in tokenizer.special_ids if 0 <= i < _BYTES)
    if shared:
        log.warning(
            "%s has no tokenizer.json: the byte-level fallback serves it, and the checkpoint's special ids %s are also "
            "the bytes %s, which in a text encode to those specials and decode to nothing (no round trip)",
            folder,
            shared,
            ", ".join(f"0x{i:02x}" for i in shared),
        )
    return tokenizer


def write_byte_level_tokenizer(folder: str | Path, config: LlamaConfig) -> Path:
    """Write a byte-level BPE ``tokenizer.json`` of exactly ``config.vocab_size`` ids, and its tokenizer_config.json,
    into ``folder`` (a random-weight checkpoint's): any text round-trips, as with a real model's tokenizer.

    The config's BOS id is ``<s>`` (added to every text), its first EOS id ``</s>``; the other ids are GPT-2's 256
    byte symbols, then merges of two symbols (frequent English letters and the space first, then longer merges where
    the vocabulary is larger). Built, not trained: deterministic, in milliseconds. Returns ``folder``."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as FastTokenizer

    names = {} if config.bos_token_id is None else {config.bos_token_id: "<s>"}
    for k, eos in enumerate(config.eos_token_ids):
        names.setdefault(eos, "</s>" if k == 0 else f"<|end_{k}|>")
    outside = sorted(i for i in names if not 0 <= i < config.vocab_size)
    if outside or config.vocab_size < _BYTES + len(names):
        raise ValueError(
            f"a byte-level tokenizer needs vocab_size ({config.vocab_size}) >= {_BYTES} bytes + {len(names)} special "
            f"ids, and the special ids inside it (outside: {outside})"
        )
    symbols = {b: c for c, b in _gpt2_alphabet().items()}
    ranked = [symbols[b] for b in dict.fromkeys([*_FREQUENT, *range(_BYTES)])]
    unnamed = (merge for merge in _merges(ranked) if "".join(merge) not in names.values())
    merges = list(itertools.islice(unnamed, config.vocab_size - _BYTES - len(names)))
    pieces = [*(symbols[b] for b in range(_BYTES)), *(a + b for a, b in merges)]
    free = [i for i in range(config.vocab_size) if i not in names]
    vocab = {name: i for i, name in names.items()} | dict(zip(pieces, free, strict=True))
    tokenizer = FastTokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names.values()])
    if config.bos_token_id is not None:
        bos = [("<s>", config.bos_token_id)]
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=bos)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / TOKENIZER_FILE))
    saved = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names.get(config.bos_token_id),
        "eos_token": names[config.eos_token_ids[0]] if config.eos_token_ids else None,
        "add_bos_token": config.bos_token_id is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
    }
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(saved, indent=2) + "\n")
    return folder


def _merges(ranked: list[str]) -> Iterator[tuple[str, str]]:
    """Merges over the symbols ``ranked`` by frequency: every pair, the pairs of frequent symbols first (by the sum
    of their ranks), then each pair's piece with one more symbol."""
    n = len(ranked)

    def pairs() -> Iterator[tuple[str, str]]:
        for total in range(2 * n - 1):
            for i in range(max(0, total - n + 1), min(total, n - 1) + 1):
                yield ranked[i], ranked[total - i]

    yield from pairs()
    for (a, b), c in itertools.product(pairs(), ranked):
        yield a + b, c


def _special_tokens(folder: Path) -> dict[str, str]:
    """bos_token / eos_token strings from tokenizer_config.json or special_tokens_map.json (either may be absent)."""
    found: dict[str, str] = {}
    for key, value in _fields(folder, ("special_tokens_map.json", TOKENIZER_CONFIG_FILE), ("bos_token", "eos_token")):
        content = value.get("content") if isinstance(value, dict) else value
        if isinstance(content, str):
            found[key] = content
    return found


def _fields(folder: Path, files: tuple[str, ...], keys: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(key, value) for each of ``keys`` present in each of the JSON ``files`` in ``folder`` that exist, in order."""
    found = []
    for name in files:
        path = folder / name
        if path.is_file():
            saved = json.loads(path.read_text())
            found.extend((key, saved[key]) for key in keys if key in saved)
    return found

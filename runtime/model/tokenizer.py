"""Text <-> token ids: the checkpoint's ``tokenizer.json`` through `tokenizers`, or a byte-level fallback."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

TOKENIZER_FILE = "tokenizer.json"
_BYTES = 256


class Tokenizer(Protocol):
    """What the engine and CLI need from a tokenizer."""

    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS = 256 and EOS = 257: for random-weight demo models without a tokenizer.

    Needs vocab_size >= 258; ids the bytes cannot be (>= 258) decode to nothing.
    """

    vocab_size: int
    """The model's vocabulary; must hold the 256 bytes and the two specials."""

    def __post_init__(self) -> None:
        if self.vocab_size < _BYTES + 2:
            raise ValueError(
                f"the byte tokenizer needs vocab_size >= {_BYTES + 2} (bytes + BOS/EOS), got {self.vocab_size}"
            )

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
        return bytes(i for i in ids if 0 <= i < _BYTES).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (fast tokenizer) read with the `tokenizers` library; BOS/EOS from tokenizer_config.json."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        folder = Path(folder)
        self._tokenizer = FastTokenizer.from_file(str(folder / TOKENIZER_FILE))
        special = _special_tokens(folder)
        self.bos_id = self._id(special.get("bos_token"))
        self.eos_id = self._id(special.get("eos_token"))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(folder: str | Path, vocab_size: int) -> Tokenizer:
    """The checkpoint's ``tokenizer.json`` if it has one, else :class:`ByteTokenizer` over ``vocab_size``."""
    folder = Path(folder)
    if (folder / TOKENIZER_FILE).is_file():
        return HFTokenizer(folder)
    return ByteTokenizer(vocab_size)


def _special_tokens(folder: Path) -> dict[str, str]:
    """bos_token / eos_token strings from tokenizer_config.json or special_tokens_map.json (either may be absent)."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        for key, value in json.loads(path.read_text()).items():
            if key in ("bos_token", "eos_token"):
                content = value.get("content") if isinstance(value, dict) else value
                if isinstance(content, str):
                    found[key] = content
    return found

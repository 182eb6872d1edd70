"""Tokenizers. Byte level is what enwik8 bpc is measured on; the Protocol is the seam
a subword tokenizer plugs into later."""

from __future__ import annotations

from typing import Any, Protocol

from model.errors import InvalidRequestError


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str | bytes) -> list[int]: ...

    def decode_bytes(self, ids: list[int]) -> bytes: ...

    def to_dict(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no unknowns, lossless on any input."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            return list(text)
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as err:  # JSON admits lone surrogates such as "\ud800"
            raise InvalidRequestError(f"text is not valid Unicode: {err.reason} at position {err.start}") from None

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(ids)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.name, "vocab_size": self.vocab_size}


def tokenizer_from_dict(data: dict[str, Any]) -> Tokenizer:
    from model.errors import CheckpointError

    if data.get("type") == "byte":
        return ByteTokenizer()
    raise CheckpointError(f"unknown tokenizer {data!r}; this txlserve knows 'byte'")

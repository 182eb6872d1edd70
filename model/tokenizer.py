"""Tokenizers: bytes (what enwik8 bpc is measured on) and words (WikiText, the paper's word-level models).

A generated token's text can depend on the token before it (a word tokenizer puts a space
between words but not before a comma), so text is released token by token through
``token_bytes(token, prev)``; ``prev`` is None when the previous token is not known (the text
continues a session's memory), which reads as "after a word".
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

from txlserve.errors import CheckpointError, InvalidRequestError

START = -1  # ``prev`` at the start of a text


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str | bytes) -> list[int]: ...

    def decode_bytes(self, ids: list[int]) -> bytes: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token: int, prev: int | None) -> bytes: ...

    def offsets(self, text: str) -> list[int]: ...

    def token_name(self, token: int) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


def _text(text: str | bytes) -> str:
    if isinstance(text, bytes):
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidRequestError(f"text is not valid UTF-8: {err.reason} at byte {err.start}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # JSON admits lone surrogates such as "\ud800"
        raise InvalidRequestError(f"text is not valid Unicode: {err.reason} at position {err.start}") from None
    return text


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no unknowns, lossless on any input."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            return list(text)
        return list(_text(text).encode("utf-8"))

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(ids)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def offsets(self, text: str) -> list[int]:
        """Where each token of ``encode(text)`` begins in ``text``: every byte of a character at that character."""
        return [i for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8")))]

    def token_bytes(self, token: int, prev: int | None) -> bytes:
        return bytes([token])

    def token_name(self, token: int) -> str:
        """The character if ASCII, else OpenAI's ``bytes:\\xNN``."""
        return chr(token) if token < 128 else f"bytes:\\x{token:02x}"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.name, "vocab_size": self.vocab_size}


JOINERS = {"@-@": "-", "@,@": ",", "@.@": "."}  # WikiText's marks for a split inside a word or number
NO_SPACE_BEFORE = {",", ".", ";", ":", "!", "?", ")", "]", "}", "%", "'s", "'re", "'ve", "'ll", "'d", "'m", "n't",
                   "'S", "N'T", "'t", "'T"}
NO_SPACE_AFTER = {"(", "[", "{", "$"}
_LEADING = "\"'([{$\u201c\u2018"  # and curly quotes, which WikiText writes apart: \u201c yes \u201d
_TRAILING = ".,;:!?\"')]}%\u201d\u2019"
_CLITIC = re.compile(r"^(.+?)(n't|'s|'re|'ve|'ll|'d|'m)$", re.IGNORECASE)
# a joiner inside a word or number, or beside an unknown word: "<unk>-class" (as ``<unk> @-@ class`` decodes) was one
# <unk>, two tokens lost when a session's text was re-sent (found by a helper)
_INNER = re.compile(r"(?:(?<=\w)|(?<=<unk>))([-,.])(?=\w|<unk>)")
# separators WikiText writes apart, with no joiner: 2000 \u2013 2005, km / h, 3 : 04 (each was one <unk>)
_APART = re.compile(r"(?<=\w)([\u2013\u2014/:])(?=\w)")


class WordTokenizer:
    """Whitespace-separated words with WikiText's conventions, as the paper's word-level models were trained.

    Each line ends with ``eos`` (a newline in text), a word outside the vocabulary is ``unk``,
    and text that is not already tokenized the WikiText way is split as WikiText was: punctuation
    and clitics off words (``don't`` -> ``don 't`` as WikiText writes it, or ``do n't`` where the vocabulary
    has Penn Treebank's ``n't``), en dashes, slashes and colons apart (``km/h`` -> ``km / h``), and
    ``@-@ @,@ @.@`` joiners inside words and numbers (``1,000`` -> ``1 @,@ 000``), but only where the
    whole piece is not itself a word of the vocabulary. Decoding undoes that for display. Words are
    never split across requests by the server, so text appended in pieces should break at whitespace."""

    name = "word"

    def __init__(self, symbols: list[str], *, eos: str = "<eos>", unk: str | None = "<unk>") -> None:
        if not isinstance(symbols, list) or not all(isinstance(s, str) and s for s in symbols):
            raise CheckpointError("a word vocabulary must be a list of non-empty strings")
        if (spaced := next((s for s in symbols if any(c.isspace() for c in s)), None)) is not None:  # never read
            raise CheckpointError(f"the word vocabulary's symbol {spaced!r} holds white space: text is split "
                                  "into words at white space, so no text could ever be read as it")
        self.symbols, self.index = symbols, {s: i for i, s in enumerate(symbols)}
        if len(self.index) != len(symbols):
            dup = next(s for s, n in Counter(symbols).items() if n > 1)
            raise CheckpointError(f"the word vocabulary lists {dup!r} twice")
        if not isinstance(eos, str) or not (unk is None or isinstance(unk, str)):  # a list: "unhashable" (a helper)
            raise CheckpointError(f"a word tokenizer's eos is a symbol and its unk a symbol or null, not "
                                  f"{json.dumps(eos if not isinstance(eos, str) else unk)[:60]}")
        if eos not in self.index:
            raise CheckpointError(f"the word vocabulary has no end-of-line symbol {eos!r}")
        self.eos, self.unk = eos, unk if unk in self.index else None
        self.eos_id = self.index[eos]
        self.unk_id = None if self.unk is None else self.index[self.unk]
        self.vocab_size = len(symbols)
        self.longest = max(map(len, symbols))  # no longer piece of text needs looking up
        # WikiText (Moses) writes "don't" as don 't; Penn Treebank's do n't: whichever this vocabulary holds
        self.moses = "n't" not in self.index and "'t" in self.index

    @classmethod
    def build(cls, lines: Iterable[str], *, min_freq: int = 1, max_size: int | None = None,
              specials: tuple[str, ...] = ("<eos>",)) -> WordTokenizer:
        """A frequency-ordered vocabulary, as the original code builds it: specials first, then words by
        count (ties in first-seen order), keeping those seen at least ``min_freq`` times."""
        counts: Counter[str] = Counter()
        for line in lines:
            counts.update(line.split())
        words = [w for w, n in counts.most_common(max_size) if n >= min_freq and w not in specials]
        if len(words) < len(counts) and "<unk>" not in words:  # some words left out: they need a symbol
            specials = (*specials, "<unk>")
        symbols = list(specials) + words
        return cls(symbols, unk="<unk>" if "<unk>" in symbols else None)

    def _lookup(self, word: str) -> int:
        i = self.index.get(word)
        if i is not None:
            return i
        if self.unk_id is None:
            raise InvalidRequestError(f"the word {word[:40]!r} is not in the vocabulary, which has no unknown-word "
                                      "symbol")
        return self.unk_id

    def _known(self, chunk: str, i: int = 0, j: int | None = None) -> bool:
        """Whether ``chunk[i:j]`` is a word, sliced only when it could be one (a long chunk's slices cost)."""
        j = len(chunk) if j is None else j
        return j - i <= self.longest and chunk[i:j] in self.index

    def _split(self, chunk: str) -> list[str]:
        """WikiText's tokenization of one whitespace-free chunk not in the vocabulary. Linear in its length: the
        punctuation stripped one character at a time was a new string and a lookup each, and a 300,000-character
        chunk took 14 s (found by a helper)."""
        if self._known(chunk):
            return [chunk]
        i, j = 0, len(chunk)
        while j - i > 1 and chunk[i] in _LEADING and not self._known(chunk, i, j):
            i += 1
        while j - i > 1 and chunk[j - 1] in _TRAILING and not self._known(chunk, i, j):
            j -= 1
        head, core, tail = list(chunk[:i]), chunk[i:j], list(chunk[j:])
        middle = [core]
        if not self._known(core) and (m := _CLITIC.match(core)):
            word, clitic = m.group(1), m.group(2)
            if self.moses and clitic.lower() == "n't":
                word, clitic = word + clitic[0], clitic[1:]  # don't: don 't
            middle = [word, clitic]
        words = []
        for piece in middle:
            if self._known(piece) or not (_INNER.search(piece) or _APART.search(piece)):
                words.append(piece)
                continue
            for part in _APART.sub(lambda m: f" {m.group(1)} ", piece).split():
                words.extend([part] if self._known(part) else _INNER.sub(lambda m: f" @{m.group(1)}@ ", part).split())
        return head + words + tail

    def encode(self, text: str | bytes) -> list[int]:
        lines = _text(text).split("\n")
        ids: list[int] = []
        for i, line in enumerate(lines):
            ids.extend(self._lookup(w) for chunk in line.split() for w in self._split(chunk))
            if i < len(lines) - 1:
                ids.append(self.eos_id)
        return ids

    def offsets(self, text: str) -> list[int]:
        """Where each token of ``encode(text)`` begins in ``text``, as OpenAI's ``text_offset`` counts: a word at
        its first character (an unknown word at the word it stands for), a joiner such as ``@,@`` at its mark,
        ``<eos>`` at its newline. Decoding does not give the text back (spacing, unknown words), so offsets
        counted over the decoded text pointed elsewhere in an echoed prompt."""
        out: list[int] = []
        base = 0
        for line in _text(text).split("\n"):
            at = 0
            for chunk in line.split():
                at = line.index(chunk, at)
                cursor = 0
                for word in self._split(chunk):  # the pieces of a chunk, in order: each where the last ended
                    mark = word if chunk.startswith(word, cursor) else JOINERS.get(word, word)
                    cursor = max(chunk.find(mark, cursor), cursor)
                    out.append(base + at + cursor)
                    cursor += len(mark)
                at += len(chunk)
            base += len(line) + 1
            out.append(base - 1)  # the line's <eos>, at its newline
        return out[:-1]  # the last line has none

    def token_bytes(self, token: int, prev: int | None) -> bytes:
        sym = self.symbols[token]
        if token == self.eos_id:
            return b"\n"
        before = None if prev is None or prev == START else self.symbols[prev]
        glued = (prev == START or prev == self.eos_id or sym in JOINERS or sym in NO_SPACE_BEFORE
                 or before in JOINERS or before in NO_SPACE_AFTER)
        return (("" if glued else " ") + JOINERS.get(sym, sym)).encode("utf-8")

    def decode_bytes(self, ids: list[int], prev: int | None = START) -> bytes:
        out = []
        for token in ids:
            out.append(self.token_bytes(token, prev))
            prev = token
        return b"".join(out)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8")

    def token_name(self, token: int) -> str:
        return self.symbols[token]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.name, "vocab_size": self.vocab_size, "eos": self.eos, "unk": self.unk,
                "symbols": self.symbols}


def tokenizer_from_dict(data: dict[str, Any]) -> Tokenizer:
    kind = data.get("type") if isinstance(data, dict) else None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "word":
        return WordTokenizer(data.get("symbols"), eos=data.get("eos", "<eos>"), unk=data.get("unk"))
    raise CheckpointError(f"unknown tokenizer type {kind!r}; this txlserve knows 'byte' and 'word'")


def tokenizer_id(tokenizer: Tokenizer) -> str:
    """Names a tokenizer by what it does: two checkpoints whose ids agree read text into the same token ids, so
    a session's token window written under one is a valid history for the other."""
    doc = tokenizer.to_dict()
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    return f"{doc.get('type', 'unknown')}:{digest}"

"""How a pickle is told by its first bytes: txlserve never loads one, and says so by name where a user gives one
in place of the safe file (a torch.save checkpoint, a pickled vocabulary, a pickled session)."""

from __future__ import annotations


def looks_pickled(head: bytes) -> bool:
    """A pickle's protocol byte (protocol 2 and later), or a zip archive's signature, as torch.save writes."""
    return head[:1] == b"\x80" or head[:4] == b"PK\x03\x04"

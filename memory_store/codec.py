"""Turn a session state into (header, payload) bytes and back, validating both ways.

The header is a small self-describing JSON document, so a session can be listed,
inspected and checked for compatibility without touching its tensors; the
payload is ``safetensors`` bytes (no pickle, so a hostile payload can at worst
fail to decode). The header declares the payload's size, which catches a
truncated write before ``safetensors`` sees it.

Tensors whose name starts with ``_`` (a key/value cache, say) are hot-only:
:func:`persisted` drops them before encoding and the store keeps them on the
device only.

A record has one of two forms. ``state``: the hidden states (``mems``, and
``last_logits``) plus, since format 2, the session's last tokens (``window``,
int32), from which any model with the same tokenizer can rebuild it. ``window``
(the cold tier): the token window alone, a few bytes per token, whatever the
model's size. Records in the window form are written as format 2, so a server
that predates them refuses them as too new instead of misreading them.

Since format 3 a state record's ``mems`` are not in the payload but in a raw
**ring** beside it, in the header's dtype, little-endian, slot-major
``[slots, n_layer, d_model]``: its ``mem_rows`` rows are the positions before
``tokens_seen``, position p in slot ``p % mem_len``, and until the memory wraps
the ring holds only the slots filled so far (:func:`ring_held`). A request that
appended n < mem_len tokens then rewrites only their slots (:func:`ring_patch`),
not the whole memory: the hidden states of past tokens never change, and a
memory's size does not depend on the document's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch

from txlserve.errors import InvalidRequestError, PayloadTooLarge, SessionCorrupt, SessionIncompatible

FORMAT_VERSION = 3  # the newest this code reads and the version of every state record it writes
RING_FORMAT = 3  # state records from this version on keep their mems in the ring
MEMS = "mems"
WINDOW = "window"
STATE_FORM, WINDOW_FORM = "state", "window"
MAX_METADATA_BYTES = 64 * 1024
_RING_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}  # of a memory
TOKENS_SEEN_MAX = 1 << 62  # the most tokens a session counts (a header's bound)
# Bounds no real model comes near; a header outside them was not written by txlserve.
_RANGES: dict[str, tuple[int, int]] = {
    "n_layer": (1, 4096),
    "d_model": (1, 1 << 20),
    "mem_len": (0, 1 << 20),
    "tokens_seen": (0, TOKENS_SEEN_MAX),
    "version": (0, 1 << 62),
    "payload_bytes": (0, 1 << 40),
}


@dataclass(frozen=True)
class ModelIdentity:
    """What a stored state must match to be usable by the running model."""

    fingerprint: str
    n_layer: int
    d_model: int
    tokenizer: str = ""  # a session written under the same tokenizer can be rebuilt from its window
    window_len: int = 0  # the tokens its rebuild reads (n_layer * mem_len + 1): what its writes keep at least


@dataclass(frozen=True)
class Header:
    """The self-describing first half of a stored session (``format_version`` 1)."""

    fingerprint: str
    n_layer: int
    d_model: int
    mem_len: int
    dtype: str
    tokens_seen: int
    version: int
    owner: str | None
    created_at: float
    updated_at: float
    metadata: dict[str, Any]
    payload_bytes: int
    format_version: int = 1
    form: str = STATE_FORM  # "state" | "window"
    tokenizer: str = ""
    window_tokens: int = 0  # how many of its last tokens the record holds (0: none, a session from before windows)
    mem_rows: int = 0  # rows of mems in the ring (format 3)
    # the longest window of the models that wrote it: a model that reads less cuts the window to no fewer tokens,
    # so that the one that wrote it can still rebuild it (0: written before this field; its window's length)
    window_span: int = 0

    @property
    def revision(self) -> tuple[int, float]:
        """What a copy kept outside Redis must match (``SessionInfo.revision``, the same pair)."""
        return self.version, self.updated_at


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "format_version": (int,),
    "fingerprint": (str,),
    "n_layer": (int,),
    "d_model": (int,),
    "mem_len": (int,),
    "dtype": (str,),
    "tokens_seen": (int,),
    "version": (int,),
    "owner": (str, type(None)),
    "created_at": (int, float),
    "updated_at": (int, float),
    "metadata": (dict,),
    "payload_bytes": (int,),
}
_OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {"form": (str,), "tokenizer": (str,), "window_tokens": (int,),
                                                 "mem_rows": (int,), "window_span": (int,)}


def is_hot_only(name: str) -> bool:
    return name.startswith("_")


def persisted(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors that are written to Redis (everything not hot-only)."""
    return {name: t for name, t in tensors.items() if not is_hot_only(name)}


def state_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


# A state this small is encoded (and exported) on the event loop: a thread hop costs more than the copy
# (~0.2 ms for 512 KB), and 64 requests ending together queued behind each other in the thread pool.
INLINE_BYTES = 1 << 20


def check_state(
    tensors: Mapping[str, torch.Tensor], *, identity: ModelIdentity, mem_len: int, tokens_seen: int
) -> None:
    """Refuse a state before it is written, so that nothing unreadable is ever stored."""
    if not isinstance(tensors, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise InvalidRequestError("session state must be a dict of str -> torch.Tensor", param="tensors")
    for name, value in (("mem_len", mem_len), ("tokens_seen", tokens_seen)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequestError(f"{name} must be an integer >= 0, got {value!r}", param=name)
        if value > _RANGES[name][1]:  # a header outside its range is unreadable
            raise InvalidRequestError(f"{name} must be at most {_RANGES[name][1]}, got {value}", param=name)
    mems, window = tensors.get(MEMS), tensors.get(WINDOW)
    if mems is None and window is None:
        raise SessionIncompatible(f"session state has neither {MEMS!r} nor {WINDOW!r}", param="tensors")
    if mems is not None:
        _check_mems_shape(tuple(mems.shape), identity=identity, mem_len=mem_len, error=SessionIncompatible)
        if str(mems.dtype) not in _RING_DTYPES:
            raise SessionIncompatible(f"{MEMS} is {mems.dtype}; a memory is stored as one of "
                                      f"{', '.join(_RING_DTYPES)}", param="tensors")
    if window is not None:
        _check_window(window, tokens_seen, error=InvalidRequestError)


def check_metadata(metadata: Mapping[str, Any] | None, *, max_bytes: int = MAX_METADATA_BYTES) -> dict[str, Any]:
    """Metadata lives in the header, so it must be small JSON; returns a private copy."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise InvalidRequestError("metadata must be a JSON object", param="metadata")
    if not all(isinstance(v, str) for v in metadata.values()):  # as every API takes it (OpenAI's): text values
        raise InvalidRequestError("metadata's values must be strings", param="metadata")
    try:  # UTF-8, as the header stores it: text that is not ASCII counts its bytes, not its \\uXXXX escapes
        raw = json.dumps(dict(metadata), allow_nan=False, ensure_ascii=False).encode()  # a lone surrogate: no
    except (TypeError, ValueError) as err:  # UnicodeEncodeError is a ValueError
        raise InvalidRequestError(f"metadata is not valid JSON text: {err}", param="metadata") from None
    if len(raw) > max_bytes:
        raise PayloadTooLarge(f"metadata is {len(raw)} bytes of JSON (UTF-8), over the {max_bytes}-byte limit",
                              param="metadata")
    return json.loads(raw)


def _check_mems_shape(shape: tuple[int, ...], *, identity: ModelIdentity, mem_len: int, error: type) -> None:
    ok = len(shape) == 3 and shape[0] == identity.n_layer and shape[2] == identity.d_model and shape[1] <= mem_len
    if not ok:
        raise error(
            f"{MEMS} has shape {list(shape)}, expected [{identity.n_layer}, m <= {mem_len}, {identity.d_model}]"
        )


def _check_window(window: torch.Tensor, tokens_seen: int, *, error: type) -> None:
    if window.dtype != torch.int32 or window.dim() != 1:
        raise error(f"{WINDOW} must be a 1-D int32 tensor, got {window.dtype} of shape {list(window.shape)}")
    if window.numel() > tokens_seen:
        raise error(f"{WINDOW} holds {window.numel()} tokens, more than the {tokens_seen} the session has seen")
    if window.numel() and int(window.min()) < 0:
        raise error(f"{WINDOW} holds a negative token id")


def form_of(tensors: Mapping[str, torch.Tensor]) -> str:
    return STATE_FORM if MEMS in tensors else WINDOW_FORM


def encode_payload(tensors: Mapping[str, torch.Tensor], *, max_bytes: int, ring: bool = True) -> bytes:
    """safetensors bytes of the persisted tensors but ``mems``, which go to the ring (:func:`encode_ring`), or
    with ``ring=False`` stay in the payload (format 1); CPU-bound, so callers run it in a thread."""
    kept = persisted(tensors)
    size = state_nbytes(kept)
    if size > max_bytes:
        raise PayloadTooLarge(f"session state is {size} bytes, over the {max_bytes}-byte limit")
    payload = safetensors_bytes({name: t for name, t in kept.items() if not ring or name != MEMS})
    if len(payload) > max_bytes:
        raise PayloadTooLarge(f"session payload is {len(payload)} bytes, over the {max_bytes}-byte limit")
    return payload


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def safetensors_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The safetensors file of ``tensors`` (read back by ``safetensors.torch.load``): a little-endian u64 header
    length, the JSON header padded with spaces to 8 bytes, then each tensor's bytes (native order: little-endian
    hosts, as the ring assumes), widest elements first, so every tensor starts aligned to its element size.
    Written here because ``safetensors.torch.save`` took 45 us for a commit's two small tensors (its checks for
    shared storage, numpy conversions), a fifth of a commit's CPU on the event loop; this takes a few."""
    header: dict[str, dict[str, Any]] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors, key=lambda n: (-tensors[n].element_size(), n)):
        t = tensors[name]
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise InvalidRequestError(f"a session tensor of dtype {t.dtype} cannot be stored ({name!r})")
        raw = _raw(t)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([len(head).to_bytes(8, "little"), head, *blobs])


def ring_held(tokens_seen: int, rows: int, mem_len: int) -> int:
    """How many leading slots a ring holds: one per position so far until the memory wraps (a session of 10
    tokens stores 10 rows, not ``mem_len``), every slot after that, or for a state with rows from before
    position 0."""
    return tokens_seen if rows <= tokens_seen < mem_len else mem_len


def ring_size(mems: torch.Tensor, *, tokens_seen: int, mem_len: int) -> int:
    """Bytes of the ring of ``mems [n_layer, rows, d_model]`` after ``tokens_seen`` tokens."""
    return ring_held(tokens_seen, mems.size(1), mem_len) * mems.size(0) * mems.size(2) * mems.element_size()


def ring_nbytes(header: Header) -> int:
    """Bytes of the record's ring (0 for a record without one)."""
    if header.form != STATE_FORM or header.format_version < RING_FORMAT or header.dtype not in _RING_DTYPES:
        return 0
    held = ring_held(header.tokens_seen, header.mem_rows, header.mem_len)
    return held * header.n_layer * header.d_model * _RING_DTYPES[header.dtype].itemsize


def record_nbytes(header: Header) -> int:
    """What the record occupies in Redis: its payload and its ring."""
    return header.payload_bytes + ring_nbytes(header)


def ring_slots(tokens_seen: int, rows: int, mem_len: int) -> torch.Tensor:
    """The ring slots of ``rows`` positions before ``tokens_seen``, oldest first (distinct: rows <= mem_len)."""
    return torch.arange(tokens_seen - rows, tokens_seen).remainder(max(mem_len, 1))  # [rows]


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # numpy reads these (not bf16)


def _raw(t: torch.Tensor) -> bytes:
    """``t``'s elements in row-major order, in one copy (numpy orders a strided view's bytes as it copies)."""
    t = t.detach().to("cpu")
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy().tobytes() if t.numel() else b""


def encode_ring(mems: torch.Tensor, *, tokens_seen: int, mem_len: int) -> bytes:
    """The ring bytes of ``mems [n_layer, rows, d_model]`` (oldest first) after ``tokens_seen`` tokens: slot by
    slot, every layer's row of one position together, so that an append is one or two contiguous runs."""
    rows = mems.size(1)
    ring = torch.zeros(ring_held(tokens_seen, rows, mem_len), mems.size(0), mems.size(2),
                       dtype=mems.dtype)  # [slots held, n_layer, d_model]
    ring[ring_slots(tokens_seen, rows, mem_len)] = mems.detach().to("cpu").transpose(0, 1)
    return _raw(ring)


@dataclass(frozen=True)
class RingPatch:
    """What turns the stored ring of a session after ``before`` tokens into the ring after more: the appended
    positions' slots as (byte offset, bytes) runs (two when the ring wraps), and what the stored ring must be for
    them to apply: at least ``least_rows`` rows, ``before_nbytes`` long."""

    runs: list[tuple[int, bytes]]
    least_rows: int
    before_nbytes: int
    full_nbytes: int  # the ring's length once every slot is held (mem_len of them)


def ring_patch(mems: torch.Tensor, *, before: int, tokens_seen: int, mem_len: int) -> RingPatch | None:
    """The patch from the ring after ``before`` tokens to the ring of ``mems [n_layer, m, d_model]`` (oldest
    first, ``m = min(tokens_seen, mem_len)`` as a session's memory holds) after ``tokens_seen``; None when there is
    no such patch (not an append, or one that rewrites every slot)."""
    n, rows = tokens_seen - before, mems.size(1)
    if n < 0 or n >= mem_len or rows != min(tokens_seen, mem_len):
        return None
    slot = mems.size(0) * mems.size(2) * mems.element_size()
    new = mems[:, rows - n:].detach().to("cpu").transpose(0, 1)  # [n, n_layer, d_model]: only these leave the device
    start = before % mem_len
    first = min(n, mem_len - start)
    runs = [(start * slot, _raw(new[:first]))] + ([(0, _raw(new[first:]))] if n > first else [])
    return RingPatch([run for run in runs if run[1]], rows - n, min(before, mem_len) * slot, mem_len * slot)


def decode_ring(raw: bytes | None, header: Header) -> torch.Tensor:
    """``mems [n_layer, m, d_model]`` (oldest first) of a ring that must agree with its header."""
    if raw is None:
        raise SessionCorrupt("session memory is missing (its ring key is gone)")
    if header.dtype not in _RING_DTYPES:
        raise SessionCorrupt(f"session header declares dtype {header.dtype!r}, which no memory is stored in")
    if len(raw) != ring_nbytes(header):
        raise SessionCorrupt(f"session memory is {len(raw)} bytes, its header declares {ring_nbytes(header)}")
    dtype = _RING_DTYPES[header.dtype]
    shape = (ring_held(header.tokens_seen, header.mem_rows, header.mem_len), header.n_layer, header.d_model)
    if not raw:
        ring = torch.zeros(shape, dtype=dtype)
    else:
        with warnings.catch_warnings():  # read-only bytes: the rows are copied out below, never written
            warnings.simplefilter("ignore", UserWarning)
            ring = torch.frombuffer(raw, dtype=dtype).view(shape)  # [slots held, n_layer, d_model]
    slots = ring_slots(header.tokens_seen, header.mem_rows, header.mem_len)  # [mem_rows]
    return ring[slots].transpose(0, 1).contiguous()  # [n_layer, mem_rows, d_model], a copy


def encode_header(header: Header) -> bytes:
    return json.dumps(dataclasses.asdict(header), separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()


def decode_header(raw: bytes) -> Header:
    """Parse and type-check a stored header; anything malformed is ``SessionCorrupt``."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise SessionCorrupt(f"session header is not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise SessionCorrupt("session header is not a JSON object")
    version = doc.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise SessionIncompatible(f"session header format {version} is newer than this server's ({FORMAT_VERSION})")
    for name, types in _FIELD_TYPES.items():
        value = doc.get(name, ...)
        if not isinstance(value, types) or isinstance(value, bool):
            raise SessionCorrupt(f"session header field {name!r} is missing or has the wrong type")
    for name, (low, high) in _RANGES.items():
        if not low <= doc[name] <= high:
            raise SessionCorrupt(f"session header field {name!r} is {doc[name]}, outside [{low}, {high}]")
    for name, types in _OPTIONAL_FIELDS.items():  # absent in format 1
        value = doc.get(name, Header.__dataclass_fields__[name].default)
        if not isinstance(value, types) or isinstance(value, bool):
            raise SessionCorrupt(f"session header field {name!r} has the wrong type")
        doc[name] = value
    if doc["form"] not in (STATE_FORM, WINDOW_FORM) or not 0 <= doc["window_tokens"] <= doc["tokens_seen"]:
        raise SessionCorrupt(f"session header has form {doc['form']!r} with {doc['window_tokens']} window tokens")
    if not 0 <= doc["mem_rows"] <= doc["mem_len"]:
        raise SessionCorrupt(f"session header declares {doc['mem_rows']} rows of a {doc['mem_len']}-slot memory")
    # a value that is not text (the store's Python API took any JSON once) reads as its JSON: an export of it was a
    # 500 (found by a helper), and the session stays usable and its metadata can be changed
    doc["metadata"] = {k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                       for k, v in doc["metadata"].items()}
    # Older servers stored lone surrogates, which no response can carry: keep such a session readable.
    doc["metadata"] = json.loads(json.dumps(doc["metadata"], ensure_ascii=False).encode("utf-8", "replace"))
    return Header(**{name: doc[name] for name in (*_FIELD_TYPES, *_OPTIONAL_FIELDS)})


def header_owner(raw: bytes) -> Any:
    """The owner a header names, whatever its format: a delete of a record a newer server wrote needs no more."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    return doc.get("owner") if isinstance(doc, dict) else None


def check_compatible(header: Header, identity: ModelIdentity) -> str:
    """How the running model can use a stored session: ``"state"`` (its hidden states as they are) or
    ``"window"`` (rebuilt from its last tokens: a cold record, or one written by another checkpoint with the
    same tokenizer). A session it cannot use at all is ``SessionIncompatible``."""
    same_model = (header.fingerprint, header.n_layer, header.d_model) == (
        identity.fingerprint, identity.n_layer, identity.d_model)
    if same_model and header.form == STATE_FORM:
        return STATE_FORM
    has_window = header.window_tokens > 0 or header.tokens_seen == 0
    if has_window and header.tokenizer and header.tokenizer == identity.tokenizer:
        return WINDOW_FORM
    if header.tokenizer and header.tokenizer != identity.tokenizer:
        why = f"its tokenizer {header.tokenizer!r} is not this server's {identity.tokenizer!r}"
    else:
        why = "it holds no token window to rebuild it from"
    raise SessionIncompatible(
        f"session was built by model {header.fingerprint!r} (n_layer={header.n_layer}, d_model={header.d_model}), "
        f"this server runs {identity.fingerprint!r} (n_layer={identity.n_layer}, d_model={identity.d_model}), "
        f"and {why}"
    )


def _finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in ``t``: one pass that allocates nothing (2 to 4 ms for a WikiText-103 memory on one
    core, where ``isfinite().all()`` took 85 to 115 ms); NaN propagates through both extremes."""
    return t.numel() == 0 or all(math.isfinite(float(x)) for x in torch.aminmax(t))


def decode_payload(payload: bytes, header: Header, ring: bytes | None = None) -> dict[str, torch.Tensor]:
    """CPU tensors of a payload (and, since format 3, its ring) that must agree with its header; CPU-bound,
    run it in a thread."""
    if len(payload) != header.payload_bytes:
        raise SessionCorrupt(f"session payload is {len(payload)} bytes, its header declares {header.payload_bytes}")
    try:
        tensors = safetensors.torch.load(payload)
    except Exception as err:  # safetensors raises its own SafetensorError, or ValueError, or OSError
        raise SessionCorrupt(f"session payload does not decode: {err}") from None
    window = tensors.get(WINDOW)
    if window is not None:
        _check_window(window, header.tokens_seen, error=SessionCorrupt)
    if (0 if window is None else window.numel()) != header.window_tokens:
        raise SessionCorrupt(f"session payload holds a window of {0 if window is None else window.numel()} "
                             f"tokens, its header declares {header.window_tokens}")
    if header.form == WINDOW_FORM:
        if MEMS in tensors:
            raise SessionCorrupt(f"a window-form session payload holds {MEMS!r}")
        return tensors
    if header.format_version >= RING_FORMAT:
        if MEMS in tensors:
            raise SessionCorrupt(f"a format-{header.format_version} session payload holds {MEMS!r}")
        if ring is None and window is not None and window.numel():
            return tensors  # its memory expired or was lost: rebuilt from its window, as a cold session is
        tensors[MEMS] = decode_ring(ring, header)
    mems = tensors.get(MEMS)
    if mems is None:
        raise SessionCorrupt(f"session payload has no {MEMS!r} tensor")
    identity = ModelIdentity(header.fingerprint, header.n_layer, header.d_model)
    _check_mems_shape(tuple(mems.shape), identity=identity, mem_len=header.mem_len, error=SessionCorrupt)
    if str(mems.dtype) != header.dtype:
        raise SessionCorrupt(f"{MEMS} is {mems.dtype}, its header declares {header.dtype}")
    if not _finite(mems):  # a damaged memory had continued as NaNs: 200s of garbage, and committed
        if window is not None and window.numel() >= min(header.tokens_seen, header.mem_len):
            del tensors[MEMS]  # rebuilt from its window, as a session whose ring was lost
            return tensors
        raise SessionCorrupt(f"session {MEMS} hold values that are not finite, and no window to rebuild them from")
    return tensors

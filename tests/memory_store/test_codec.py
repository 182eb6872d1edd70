"""Header and payload encoding: bit-exact round trips and every way a stored session can be refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import safetensors.torch
import torch

from memory_store import codec
from memory_store.codec import Header
from tests.memory_store.support import D_MODEL, IDENTITY, MEM, N_LAYER, assert_same, make_state
from txlserve.errors import InvalidRequestError, PayloadTooLarge, SessionCorrupt, SessionIncompatible

pytestmark = pytest.mark.timeout(90)


def header_for(payload: bytes, dtype: str = "torch.float32", **changes: object) -> Header:
    """A header for ``payload``; format 1 (mems inside the payload) unless changed."""
    header = Header(
        fingerprint=IDENTITY.fingerprint,
        n_layer=N_LAYER,
        d_model=D_MODEL,
        mem_len=8,
        dtype=dtype,
        tokens_seen=0,
        version=1,
        owner=None,
        created_at=0.0,
        updated_at=0.0,
        metadata={},
        payload_bytes=len(payload),
    )
    return dataclasses.replace(header, **changes)


def record(state: dict[str, torch.Tensor], *, tokens_seen: int = MEM, mem_len: int = 8,
           **changes: object) -> tuple[bytes, bytes, Header]:
    """(payload, ring, header) of a state as the store writes it (format 3)."""
    payload = codec.encode_payload(state, max_bytes=1 << 20)
    ring = codec.encode_ring(state["mems"], tokens_seen=tokens_seen, mem_len=mem_len)
    header = header_for(payload, str(state["mems"].dtype), format_version=codec.RING_FORMAT, tokens_seen=tokens_seen,
                        mem_len=mem_len, mem_rows=state["mems"].size(1))
    return payload, ring, dataclasses.replace(header, **changes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "tokens_seen"), [(8, 8), (8, 21), (3, 3), (3, 40), (0, 0), (5, 2)])
def test_record_round_trip_is_bit_exact(dtype: torch.dtype, rows: int, tokens_seen: int) -> None:
    state = make_state(rows, dtype=dtype)
    state["extra"] = torch.arange(5, dtype=torch.int64)
    state["last_logits"] = torch.tensor([float("nan"), float("-inf"), 1.0], dtype=dtype)  # their bits kept too
    payload, ring, header = record(state, tokens_seen=tokens_seen)
    held = tokens_seen if rows <= tokens_seen < 8 else 8  # a memory that has not wrapped stores only its rows
    assert len(ring) == codec.ring_nbytes(header) == held * N_LAYER * D_MODEL * state["mems"].element_size()
    assert b"mems" not in payload  # the memory lives in the ring
    assert_same(codec.decode_payload(payload, header, ring), state)


def test_a_format_1_record_still_reads() -> None:
    state = make_state()
    payload = safetensors.torch.save(state)  # as servers before the ring wrote it: mems in the payload
    assert_same(codec.decode_payload(payload, header_for(payload)), state)


def test_hot_only_tensors_are_not_encoded() -> None:
    payload, ring, header = record(make_state(hot_only=True))
    assert set(codec.decode_payload(payload, header, ring)) == {"mems"}


def test_views_and_shared_storage_encode() -> None:
    buffer = torch.randn(2 * N_LAYER, 8, D_MODEL)
    state = {"mems": buffer[:N_LAYER], "other": buffer[N_LAYER:], "t": buffer.transpose(1, 2)}
    payload, ring, header = record(state)
    decoded = codec.decode_payload(payload, header, ring)
    assert all(torch.equal(decoded[name], state[name]) for name in state)


@pytest.mark.parametrize(("before", "n"), [(8, 3), (13, 5), (15, 7), (5, 2), (2, 6), (100, 0), (9, 1), (0, 5),
                                          (0, 7), (3, 5), (6, 7)])
def test_a_patch_writes_only_the_appended_rows_and_equals_the_whole_ring(before: int, n: int) -> None:
    """A session after ``before`` tokens appends ``n``: its stored ring, patched (as SETRANGE does: past the end
    it grows the string), is the ring of the new state written whole, wrapping at the ring's end included, and
    the patch is only the n new rows, in at most two runs."""
    mem_len, doc = 8, make_state(before + n, seed=3)["mems"]  # [n_layer, tokens, d_model]
    old, new = doc[:, max(0, before - mem_len):before], doc[:, max(0, before + n - mem_len):before + n]
    ring = bytearray(codec.encode_ring(old, tokens_seen=before, mem_len=mem_len))
    patch = codec.ring_patch(new, before=before, tokens_seen=before + n, mem_len=mem_len)
    assert patch is not None
    assert patch.before_nbytes == len(ring) and patch.least_rows == new.size(1) - n <= old.size(1)
    for offset, raw in patch.runs:
        ring[len(ring):offset] = bytes(max(0, offset - len(ring)))
        ring[offset:offset + len(raw)] = raw
    assert ring == codec.encode_ring(new, tokens_seen=before + n, mem_len=mem_len)
    assert sum(len(raw) for _, raw in patch.runs) == n * N_LAYER * D_MODEL * 4 and len(patch.runs) <= 2


def test_no_patch_when_the_whole_ring_is_new_or_the_state_is_not_a_sessions() -> None:
    mems = make_state()["mems"]
    assert codec.ring_patch(mems, before=4, tokens_seen=12, mem_len=8) is None  # 8 new tokens: every slot
    assert codec.ring_patch(mems, before=12, tokens_seen=4, mem_len=8) is None  # not an append
    assert codec.ring_patch(mems, before=3, tokens_seen=5, mem_len=8) is None  # 8 rows after 5 tokens


def test_a_short_session_stores_only_its_rows() -> None:
    """10 tokens of a 1600-slot memory: 10 rows stored, not 1600."""
    mems = torch.zeros(N_LAYER, 10, D_MODEL)
    assert len(codec.encode_ring(mems, tokens_seen=10, mem_len=1600)) == 10 * N_LAYER * D_MODEL * 4


def test_a_ring_that_disagrees_with_its_header_is_corrupt() -> None:
    payload, ring, header = record(make_state())
    with pytest.raises(SessionCorrupt, match="missing"):
        codec.decode_payload(payload, header, None)
    with pytest.raises(SessionCorrupt, match="declares"):
        codec.decode_payload(payload, header, ring[:-4])
    with pytest.raises(SessionCorrupt, match="declares"):
        codec.decode_payload(payload, dataclasses.replace(header, dtype="torch.bfloat16"), ring)
    with pytest.raises(SessionCorrupt, match="no memory"):
        codec.decode_payload(payload, dataclasses.replace(header, dtype="torch.int64"), ring)
    with_mems = codec.encode_payload({"last_logits": torch.zeros(3)}, max_bytes=1 << 20)
    stale = safetensors.torch.save(make_state())  # a format-3 header over a payload holding mems
    with pytest.raises(SessionCorrupt, match="holds 'mems'"):
        codec.decode_payload(stale, dataclasses.replace(header, payload_bytes=len(stale)), ring)
    assert "mems" in codec.decode_payload(with_mems, dataclasses.replace(header, payload_bytes=len(with_mems)), ring)
    with pytest.raises(SessionCorrupt, match="rows"):
        codec.decode_header(codec.encode_header(dataclasses.replace(header, mem_rows=9)))


def test_a_memory_that_is_not_finite_is_rebuilt_from_its_window_or_refused() -> None:
    """A damaged ring (NaNs) had continued as NaNs: 200s of garbage, and the garbage committed (found by a helper)."""
    window = torch.arange(8, dtype=torch.int32)
    state = make_state()
    state["mems"][1, 2, 3] = float("nan")
    payload, ring, header = record({**state, "window": window}, window_tokens=8)
    assert set(codec.decode_payload(payload, header, ring)) == {"window"}  # as a ring that was lost
    payload, ring, header = record(state)
    with pytest.raises(SessionCorrupt, match="not finite"):
        codec.decode_payload(payload, header, ring)
    state["mems"][1, 2, 3] = float("inf")
    payload, ring, header = record({**state, "window": window[:5]}, window_tokens=5)  # too short to rebuild from
    with pytest.raises(SessionCorrupt, match="not finite"):
        codec.decode_payload(payload, header, ring)


def test_a_lost_ring_leaves_the_window_to_rebuild_from() -> None:
    window = torch.arange(8, dtype=torch.int32)
    payload, ring, header = record({**make_state(), "window": window}, window_tokens=8)
    assert set(codec.decode_payload(payload, header, ring)) == {"mems", "window"}
    assert set(codec.decode_payload(payload, header, None)) == {"window"}  # rebuilt, as a cold session is


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.complex64])
def test_a_memory_in_a_dtype_it_cannot_be_stored_in_is_refused_before_writing(dtype: torch.dtype) -> None:
    with pytest.raises(SessionIncompatible, match="stored as one of"):
        codec.check_state({"mems": torch.zeros(N_LAYER, 4, D_MODEL, dtype=dtype)}, identity=IDENTITY, mem_len=8,
                          tokens_seen=4)


def test_a_mem_len_beyond_any_model_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="mem_len"):
        codec.check_state(make_state(), identity=IDENTITY, mem_len=(1 << 20) + 1, tokens_seen=8)


def test_header_round_trip() -> None:
    header = header_for(b"x" * 10, owner="alice", metadata={"title": "é"})
    assert codec.decode_header(codec.encode_header(header)) == header


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe garbage",
        b"[1, 2]",
        json.dumps({"format_version": 1}).encode(),
        codec.encode_header(header_for(b""))[:-7],
        codec.encode_header(header_for(b"")).replace(b'"version":1', b'"version":"1"'),
    ],
    ids=["bytes", "not-object", "missing-fields", "truncated", "wrong-type"],
)
def test_bad_header_is_corrupt(raw: bytes) -> None:
    with pytest.raises(SessionCorrupt):
        codec.decode_header(raw)


def test_newer_header_format_is_incompatible() -> None:
    raw = codec.encode_header(dataclasses.replace(header_for(b""), format_version=codec.FORMAT_VERSION + 1))
    with pytest.raises(SessionIncompatible):
        codec.decode_header(raw)


def test_payload_that_disagrees_with_its_header_is_corrupt() -> None:
    payload = safetensors.torch.save(make_state())  # format 1: mems in the payload
    with pytest.raises(SessionCorrupt, match="declares"):
        codec.decode_payload(payload[:-3], header_for(payload))
    with pytest.raises(SessionCorrupt, match="does not decode"):
        garbage = b"\x00" * len(payload)
        codec.decode_payload(garbage, header_for(garbage))
    with pytest.raises(SessionCorrupt, match="bfloat16"):
        codec.decode_payload(payload, header_for(payload, "torch.bfloat16"))
    with pytest.raises(SessionCorrupt, match="shape"):
        codec.decode_payload(payload, header_for(payload, mem_len=4))


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"other": torch.zeros(N_LAYER, 8, D_MODEL)}, "neither 'mems'"),
        ({"mems": torch.zeros(N_LAYER + 1, 8, D_MODEL)}, "shape"),
        ({"mems": torch.zeros(N_LAYER, 8, D_MODEL + 1)}, "shape"),
        ({"mems": torch.zeros(N_LAYER, 9, D_MODEL)}, "m <= 8"),
        ({"mems": torch.zeros(N_LAYER, D_MODEL)}, "shape"),
    ],
)
def test_state_of_another_shape_is_refused(state: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(SessionIncompatible, match=match):
        codec.check_state(state, identity=IDENTITY, mem_len=8, tokens_seen=0)


def test_invalid_state_arguments() -> None:
    with pytest.raises(InvalidRequestError):
        codec.check_state({"mems": [1.0]}, identity=IDENTITY, mem_len=8, tokens_seen=0)  # type: ignore[dict-item]
    with pytest.raises(InvalidRequestError, match="tokens_seen"):
        codec.check_state(make_state(), identity=IDENTITY, mem_len=8, tokens_seen=-1)
    with pytest.raises(InvalidRequestError, match="metadata"):
        codec.check_metadata({"when": object()})
    with pytest.raises(InvalidRequestError, match="values must be strings"):
        codec.check_metadata({"n": 1})  # the store writes what every server reads back: text values
    # one a header holds (the store's Python API took any JSON once, or a hand's edit) reads as its JSON text: its
    # export was a 500
    stored = dataclasses.replace(header_for(b""), metadata={"n": 1, "l": [1, "é"], "s": "x"})
    assert codec.decode_header(codec.encode_header(stored)).metadata == {"n": "1", "l": '[1, "é"]', "s": "x"}
    with pytest.raises(PayloadTooLarge):
        codec.check_metadata({"blob": "x" * (codec.MAX_METADATA_BYTES + 1)})
    # UTF-8 bytes, as the header stores them: 60,000 of "é" (30,000 characters) fit; their \\u00e9 escapes were
    # counted (180,000 bytes), and refused
    text = {"a": "é" * 30_000}
    assert codec.check_metadata(text) == text
    header = codec.decode_header(codec.encode_header(dataclasses.replace(header_for(b""), metadata=text)))
    assert header.metadata == text
    with pytest.raises(PayloadTooLarge, match="UTF-8"):
        codec.check_metadata({"a": "é" * (codec.MAX_METADATA_BYTES // 2)})


def test_fingerprint_and_shape_mismatch_are_incompatible() -> None:
    with pytest.raises(SessionIncompatible, match="built by model"):
        codec.check_compatible(header_for(b"", fingerprint="other-model"), IDENTITY)
    with pytest.raises(SessionIncompatible, match="d_model"):
        codec.check_compatible(header_for(b"", d_model=D_MODEL * 2), IDENTITY)


def test_oversized_payload_is_refused_before_encoding() -> None:
    state = make_state()
    with pytest.raises(PayloadTooLarge):
        codec.encode_payload(state, max_bytes=state["mems"].nbytes - 1)


def test_a_format_1_header_reads_as_a_state_without_a_window() -> None:
    doc = dataclasses.asdict(header_for(b""))
    for name in ("form", "tokenizer", "window_tokens"):
        del doc[name]
    header = codec.decode_header(json.dumps(doc).encode())
    assert (header.form, header.tokenizer, header.window_tokens, header.format_version) == ("state", "", 0, 1)


def test_window_records_round_trip_and_must_agree_with_their_header() -> None:
    window = torch.arange(7, dtype=torch.int32)
    cold = codec.encode_payload({"window": window}, max_bytes=1 << 20)
    header = header_for(cold, "torch.int32", form="window", window_tokens=7, tokens_seen=9, format_version=2)
    assert torch.equal(codec.decode_payload(cold, header)["window"], window)
    with pytest.raises(SessionCorrupt, match="declares 5"):
        codec.decode_payload(cold, dataclasses.replace(header, window_tokens=5))
    with pytest.raises(SessionCorrupt, match="more than"):
        codec.decode_payload(cold, dataclasses.replace(header, tokens_seen=3))
    warm = safetensors.torch.save({**make_state(), "window": window})
    with pytest.raises(SessionCorrupt, match="window-form"):
        codec.decode_payload(warm, dataclasses.replace(header, payload_bytes=len(warm)))
    with pytest.raises(InvalidRequestError, match="int32"):
        codec.check_state({"window": window.long()}, identity=IDENTITY, mem_len=8, tokens_seen=9)


def test_which_sessions_another_model_can_use() -> None:
    mine = dataclasses.replace(IDENTITY, tokenizer="byte:a")
    state = header_for(b"", tokenizer="byte:a", window_tokens=17, tokens_seen=40)
    assert codec.check_compatible(state, mine) == "state"
    assert codec.check_compatible(dataclasses.replace(state, form="window"), mine) == "window"  # cold
    upgraded = dataclasses.replace(mine, fingerprint="next-checkpoint", d_model=D_MODEL * 2)
    assert codec.check_compatible(state, upgraded) == "window"  # same tokenizer: rebuilt from the window
    with pytest.raises(SessionIncompatible, match="tokenizer"):
        codec.check_compatible(state, dataclasses.replace(upgraded, tokenizer="word:b"))
    with pytest.raises(SessionIncompatible, match="no token window"):
        codec.check_compatible(dataclasses.replace(state, window_tokens=0), upgraded)


def test_safetensors_bytes_read_back_by_safetensors_for_every_dtype_and_layout():
    """The payload writer of the commit path: strided views, empty and 0-d tensors, every dtype a state holds
    (bf16 too, which numpy cannot name), read back exactly by the safetensors library."""
    tensors = {
        "last_logits": torch.randn(256),
        "window": torch.arange(300, dtype=torch.int32),
        "strided": torch.randn(3, 4).to(torch.bfloat16).t(),  # a transposed view: copied in row-major order
        "empty": torch.zeros(0, 5, dtype=torch.float16),
        "scalar": torch.tensor(7),
        "mask": torch.tensor([True, False, True]),
        "wide": torch.randn(2, 3, dtype=torch.float64)[:, ::2],
    }
    back = safetensors.torch.load(codec.safetensors_bytes(tensors))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name


def test_a_commits_payload_is_byte_for_byte_what_safetensors_writes():
    payload = {"last_logits": torch.randn(256), "window": torch.arange(40, dtype=torch.int32)}
    assert codec.safetensors_bytes(payload) == safetensors.torch.save(payload)
    legacy = {"mems": torch.randn(2, 3, 4).to(torch.bfloat16), **payload}  # format 1: mems in the payload
    raw = codec.safetensors_bytes(legacy)
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    for name, entry in header.items():  # widest elements first: every tensor aligned to its element size
        assert entry["data_offsets"][0] % legacy[name].element_size() == 0, name
    with pytest.raises(InvalidRequestError, match="uint16"):
        codec.safetensors_bytes({"odd": torch.zeros(2, dtype=torch.uint16)})

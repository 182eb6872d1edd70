"""A word-level adaptive-softmax model (imported from the Hugging Face layout) served end to end over real
HTTP: completions, SSE, sessions and the WebSocket speak in words."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from websockets.sync.client import connect

from model.checkpoint import save_checkpoint
from model.config import TXLConfig
from model.tokenizer import WordTokenizer
from model.transformer_xl import MemTransformerLM
from tests.live import MODEL, LiveServer
from tests.server.test_ws import collect, ws_url

WORDS = ["<eos>", "<unk>", "the", "a", "cat", "dog", ",", ".", "@-@", "saw", "ran", "home", "(", ")", "'s", "n't"]
VOCAB = WORDS + [f"w{i}" for i in range(len(WORDS), 70)]


@pytest.fixture(scope="module")
def word_server(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    torch.manual_seed(0)
    cfg = TXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, dropout=0.0, tgt_len=16, mem_len=12,
                    vocab_size=len(VOCAB), cutoffs=(8, 30), div_val=2, tie_projs=(False, True, True))
    model = MemTransformerLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    ck: Path = tmp_path_factory.mktemp("word-ck")
    save_checkpoint(model, ck, tokenizer=WordTokenizer(VOCAB))
    srv = LiveServer(ck, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("word-srv")).start()
    yield srv
    srv.stop()


def _post(server, path: str, **body) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code in (200, 201), r.text
    return r.json()


def test_completion_speaks_words(word_server):
    out = _post(word_server, "/v1/completions", model=MODEL, prompt="the cat saw a dog.", max_tokens=6,
                temperature=0, logprobs=2)
    (choice,) = out["choices"]
    assert out["usage"]["prompt_tokens"] == 6  # the, cat, saw, a, dog, .
    assert out["usage"]["completion_tokens"] == 6
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 6 and all(t in VOCAB for t in lp["tokens"])  # OpenAI's tokens are words
    assert all(len(top) == 2 and set(top) <= set(VOCAB) for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    tok = WordTokenizer(VOCAB)
    assert choice["text"] == tok.decode_bytes([tok.index[t] for t in lp["tokens"]], prev=None).decode()


def test_sse_and_websocket_stream_the_same_words(word_server):
    body = dict(model=MODEL, prompt="a dog ran home", max_tokens=8, temperature=0)
    want = _post(word_server, "/v1/completions", **body)["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", word_server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == want
    with connect(ws_url(word_server)) as conn:
        conn.send(json.dumps({"type": "completion.create", **body}))
        msgs = collect(conn)
    assert "".join(m["text"] for m in msgs[:-1]) == want == msgs[-1]["text"]


def test_session_across_three_requests_equals_one(word_server):
    """Appending a document in pieces (split at whitespace) and continuing equals sending it whole."""
    pieces = ["the cat saw a dog .\n", "the dog ran home ,", " a cat ran ."]
    sid = _post(word_server, "/v1/sessions", text=pieces[0])["id"]
    appended = _post(word_server, f"/v1/sessions/{sid}/append", text=pieces[1])
    assert appended["appended_tokens"] == 5 and appended["perplexity"] > 1
    split = _post(word_server, "/v1/completions", model=MODEL, prompt=pieces[2], session_id=sid, max_tokens=7,
                  temperature=0)
    whole = _post(word_server, "/v1/completions", model=MODEL, prompt="".join(pieces), max_tokens=7, temperature=0)
    assert split["choices"][0]["text"] == whole["choices"][0]["text"]
    assert split["session"]["tokens_seen"] == 7 + 5 + 4 + 7  # words, an <eos> per newline, generated words
    info = httpx.get(f"{word_server.url}/v1/sessions/{sid}", timeout=30).json()
    assert info["tokens_seen"] == 23 and info["mem_len"] == 12

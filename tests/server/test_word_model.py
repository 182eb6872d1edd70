"""A word-level adaptive-softmax model in the Hugging Face layout, imported and served end to end over real
HTTP: completions, SSE, sessions and the WebSocket speak in words."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from websockets.sync.client import connect

from model.tokenizer import WordTokenizer
from tests.live import MODEL, LiveServer
from tests.server.test_ws import collect, ws_url

WORDS = ["<eos>", "<unk>", "the", "a", "cat", "dog", ",", ".", "@-@", "saw", "ran", "home", "(", ")", "'s", "n't"]
VOCAB = WORDS + [f"w{i}" for i in range(len(WORDS), 70)]


@pytest.fixture(scope="module")
def word_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Hugging Face TransfoXLLMHeadModel in the hub's layout (config.json, model.safetensors,
    vocab.json), imported with `txlserve import hf`."""
    transformers = pytest.importorskip("transformers", reason="the dev extras install transformers==4.35.2")
    torch.manual_seed(0)
    cfg = transformers.TransfoXLConfig(vocab_size=len(VOCAB), cutoffs=[8, 30], d_model=32, d_embed=32, n_head=2,
                                       d_head=16, d_inner=64, div_val=2, n_layer=2, mem_len=13, clamp_len=0,
                                       same_length=True, dropout=0.0, dropatt=0.0)
    model = transformers.TransfoXLLMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    hf: Path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(hf, safe_serialization=True)
    (hf / "vocab.json").write_text(json.dumps({"idx2sym": VOCAB}))
    ck = tmp_path_factory.mktemp("word-ck")
    done = subprocess.run([sys.executable, "-m", "server.cli", "import", "hf", str(hf), "--out", str(ck)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return ck


@pytest.fixture(scope="module")
def word_server(word_checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[LiveServer]:
    """The word model served by a real `txlserve serve` process."""
    srv = LiveServer(word_checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("word-srv")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def in_process_word_server(word_checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
                           ) -> Iterator[LiveServer]:
    """The same, its engine in the server's process (the other request path)."""
    srv = LiveServer(word_checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("word-srv-in"),
                     args=("--no-engine-process",)).start()
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
    assert all(len(top) == 2 and set(top) <= set(VOCAB) for top in lp["top_logprobs"])  # greedy: chosen is top-1
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    tok = WordTokenizer(VOCAB)
    assert choice["text"] == tok.decode_bytes([tok.index[t] for t in lp["tokens"]], prev=None).decode()


def test_token_id_prompts_read_as_their_words(word_server):
    """OpenAI's token-id prompt on a word vocabulary: the ids /tokenize gives read as the text did, and echo
    gives their words back."""
    text = "the cat saw a dog."
    ids = _post(word_server, "/tokenize", model=MODEL, prompt=text)["tokens"]
    want = _post(word_server, "/v1/completions", model=MODEL, prompt=text, max_tokens=6, temperature=0)
    got = _post(word_server, "/v1/completions", model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert got["usage"]["prompt_tokens"] == len(ids) == 6
    echoed = got["choices"][0]["text"]
    assert echoed.endswith(want["choices"][0]["text"]) and echoed[:-len(want["choices"][0]["text"])].strip() == text
    r = httpx.post(word_server.url + "/v1/completions", json={"model": MODEL, "prompt": [len(VOCAB) + 5]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


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
    assert info["tokens_seen"] == 23 and info["mem_len"] == 12  # the published 13 under same_length


def test_stop_strings_cut_the_displayed_words(word_server):
    free = _post(word_server, "/v1/completions", model=MODEL, prompt="the cat saw", max_tokens=12,
                 temperature=0)["choices"][0]["text"]
    assert len(free) >= 12  # every word token shows at least one character
    cut = free[len(free) // 2:][:2]
    out = _post(word_server, "/v1/completions", model=MODEL, prompt="the cat saw", max_tokens=12, temperature=0,
                stop=[cut])["choices"][0]
    assert out["finish_reason"] == "stop" and out["text"] == free[:free.index(cut)]


def test_an_echoed_prompts_offsets_point_into_the_text_as_it_was_sent(word_server):
    """Decoding a word prompt does not give it back (spacing, unknown words), and the prompt's offsets were
    counted over its decoded text while the echo gives it as sent: "  the   cat" put "cat" at 3 (found by a
    helper). They index the echoed text now, and an append's index the appended text."""
    prompt = "  the   cat  saw (zebra\na dog's"
    out = _post(word_server, "/v1/completions", model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                echo=True)
    choice = out["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text.startswith(prompt)
    n = out["usage"]["prompt_tokens"]
    for name, off in zip(lp["tokens"][:n], lp["text_offset"][:n]):
        surface = {"<unk>": "zebra", "<eos>": "\n"}.get(name, name)
        assert text.startswith(surface, off), (name, off, text[off:off + 8])
    assert lp["text_offset"][n:] == sorted(lp["text_offset"][n:]) and lp["text_offset"][n] == len(prompt)
    sid = _post(word_server, "/v1/sessions", text="the cat")["id"]
    appended = _post(word_server, f"/v1/sessions/{sid}/append", text="  a  dog ran", logprobs=1)["logprobs"]
    assert appended["tokens"] == ["a", "dog", "ran"] and appended["text_offset"] == [2, 5, 9]


@pytest.mark.parametrize("where", ["word_server", "in_process_word_server"])
def test_a_prompt_ending_in_white_space_is_continued_with_no_second_space(where, request):
    """"the cat " was continued as "the cat  saw": the first word spaced from the prompt's last word, its own
    space unseen (found by a helper). Over SSE and the WebSocket too, and its offsets follow the text."""
    word_server = request.getfixturevalue(where)
    for prompt in ("the cat ", "the cat\t", "a dog ran  "):
        body = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0)
        choice = _post(word_server, "/v1/completions", **body)["choices"][0]
        text, lp = choice["text"], choice["logprobs"]
        assert text.startswith(prompt) and not text[len(prompt)].isspace(), repr(text)
        generated = lp["text_offset"][-3:]
        assert generated[0] == len(prompt) and text[generated[1]:].lstrip().startswith(lp["tokens"][-2]), (text, lp)
        with httpx.stream("POST", word_server.url + "/v1/completions", json={**body, "stream": True}) as r:
            streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                               if line.startswith("data: {") and json.loads(line[6:])["choices"])
        assert streamed == text, (streamed, text)
    plain = _post(word_server, "/v1/completions", model=MODEL, prompt="the cat", max_tokens=1, temperature=0)
    assert plain["choices"][0]["text"].startswith(" ")  # after a word, a word is still spaced


@pytest.mark.parametrize("where", ["word_server", "in_process_word_server"])
def test_an_empty_prompt_continues_a_session_spaced_as_the_whole_text(where, request):
    """With nothing to read, the first generated word was spaced as if after a word, whatever the session ended
    with: after a newline or "(" the text began with a space the whole text's continuation has not (found by a
    helper; with a stop string, a different end too). The session's last token spaces it now, and its offsets."""
    word_server = request.getfixturevalue(where)
    tok = WordTokenizer(VOCAB)
    glued = 0
    for ending, seed in [(e, s) for e in ("the cat saw a dog\n", "a dog ran (") for s in range(4)]:
        body = dict(model=MODEL, max_tokens=6, temperature=1.5, seed=seed, logprobs=1)
        whole = _post(word_server, "/v1/completions", prompt=ending, **body)["choices"][0]
        sid = _post(word_server, "/v1/sessions", text=ending)["id"]
        split = _post(word_server, "/v1/completions", prompt="", session_id=sid, **body)["choices"][0]
        assert split["logprobs"]["tokens"] == whole["logprobs"]["tokens"]
        assert split["text"] == whole["text"], (ending, seed)
        assert split["logprobs"]["text_offset"] == whole["logprobs"]["text_offset"]
        ids = [tok.index[t] for t in split["logprobs"]["tokens"]]
        first = tok.token_bytes(ids[0], tok.encode(ending)[-1]).decode()
        glued += not first.startswith(" ") and tok.token_bytes(ids[0], None).decode().startswith(" ")
    assert glued  # some case's first word is spaced otherwise after a word: the old spacing differed there

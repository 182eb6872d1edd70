"""The `txlserve` command as a user runs it: a real process, a real checkpoint on disk."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.transformer_xl import MemTransformerLM
from server.scheduler import PHASES
from tests.model.test_transformer_xl import tiny_config

REPO = Path(__file__).resolve().parents[2]


def txlserve(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ck")
    save_checkpoint(MemTransformerLM(tiny_config()), path)
    return path


def test_generate_streams_prompt_and_continuation(checkpoint):
    from concurrent.futures import ThreadPoolExecutor

    args = ("generate", "--checkpoint", str(checkpoint), "--prompt", "Hello", "--max-tokens", "12", "--seed", "3",
            "--temperature", "0.7")
    with ThreadPoolExecutor(2) as pool:  # two processes side by side, one core each
        r, again = pool.map(lambda _: txlserve(*args), range(2))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello") and len(r.stdout.encode()) > len("Hello")
    assert again.stdout == r.stdout  # seeded


def test_generate_takes_the_servers_penalties_min_p_and_min_tokens(checkpoint):
    """The same sampling fields as the server's: each changes a greedy text, or (min_p 1) keeps a sampled one on
    greedy's path; min_tokens holds a stop string back through its k-th token."""
    base = ("generate", "--checkpoint", str(checkpoint), "--prompt", "the the the the ", "--max-tokens", "24")
    greedy = txlserve(*base, "--temperature", "0")
    assert greedy.returncode == 0, greedy.stderr
    for flags in (["--repetition-penalty", "3"], ["--frequency-penalty", "2"], ["--presence-penalty", "2"]):
        r = txlserve(*base, "--temperature", "0", *flags)
        assert r.returncode == 0 and r.stdout != greedy.stdout, (flags, r.stderr)
    assert txlserve(*base, "--temperature", "1.5", "--seed", "2", "--min-p", "1").stdout == greedy.stdout
    text = greedy.stdout[len("the the the the "):].rstrip("\n")
    for k in (2, 5):  # a stop string at the first token, held back through the k-th (vLLM's min_tokens)
        r = txlserve(*base, "--temperature", "0", "--stop", text[0], "--min-tokens", str(k))
        cut = text.find(text[0], k)
        assert r.returncode == 0 and r.stdout.rstrip("\n") == "the the the the " + (text if cut < 0 else text[:cut])


def test_generate_stopped_by_ctrl_c_ends_its_line(checkpoint):
    """Ctrl-C during ``generate`` left the output mid-line, the shell's prompt glued to it (found by a helper); one
    that landed as the event loop was made printed the half-made loop's traceback at exit."""
    import select
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "generate", "--checkpoint", str(checkpoint),
                             "--prompt", "Hello", "--max-tokens", "1000000"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        first = b""
        while len(first) <= len("Hello") + 8:  # the echo, then tokens (each is flushed): stopped mid-stream
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready, f"generate wrote no more than {first!r} within 120 s"
            first += os.read(proc.stdout.fileno(), 1 << 16)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = first + rest
    assert proc.returncode == 130 and out.startswith(b"Hello") and out.endswith(b"\n"), (proc.returncode, err[-2000:])
    assert b"Traceback" not in err


def test_a_command_started_without_stdout_says_so(checkpoint, tmp_path):
    """Started with stdout closed (``>&-``), ``generate``'s first write was an AttributeError's traceback, and
    ``eval``'s figures went nowhere with exit 0 (found by a helper); now one line, as ``cat``'s write error."""
    out = tmp_path / "run"
    for args in (["generate", "--checkpoint", str(checkpoint), "--prompt", "Hello", "--max-tokens", "5"],
                 ["eval", "--checkpoint", str(checkpoint), "--data", str(REPO / "README.md"), "--split", "whole",
                  "--max-tokens", "50", "--no-progress"],
                 # refused before it works: a train had run and saved, then failed at its summary
                 ["train", "--data", str(REPO / "README.md"), "--out", str(out), "--preset", "tiny", "--steps", "1"]):
        r = subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=REPO, capture_output=False,
                           stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1),
                           timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        err = r.stderr.decode()
        assert r.returncode == 2 and "Traceback" not in err, err[-2000:]
        assert err.strip().splitlines()[-1] == ("txlserve: error: standard output is closed (redirect it: > FILE, "
                                                "or > /dev/null to discard what it says)"), err
    assert not out.exists()


def test_generate_into_a_pipe_its_reader_closes_ends_quietly(checkpoint):
    """``txlserve generate ... | head -c 100`` printed "Task was destroyed but it is pending!" and "error: [Errno 32]
    Broken pipe", exit 2 (found by a helper); now quiet, with SIGPIPE's status, as ``cat`` into ``head``."""
    import select

    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "generate", "--checkpoint", str(checkpoint),
                             "--prompt", "Hello", "--max-tokens", "1000000"], cwd=REPO, stdout=write,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(write)
    try:
        first = b""
        while len(first) <= len("Hello") + 8:  # mid-stream, as head's
            ready, _, _ = select.select([read], [], [], 120)
            assert ready, f"generate wrote no more than {first!r} within 120 s"
            first += os.read(read, 1 << 16)
        os.close(read)
        read = None
        _, err = proc.communicate(timeout=60)
    finally:
        if read is not None:
            os.close(read)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert (proc.returncode, err) == (141, b"")


def test_generate_reads_a_byte_models_prompt_as_its_bytes_and_ends_one_line(tmp_path):
    """A prompt that is not UTF-8 (a Latin-1 terminal's "caf\\xe9") was refused as "not valid Unicode" by a model
    that reads bytes; a text that ended its line was given a second newline (found by a helper)."""
    from tests.live import tiny_checkpoint

    ck = str(tiny_checkpoint(tmp_path / "ck"))  # it writes printable ASCII and newlines
    run = [sys.executable, "-m", "server.cli", "generate", "--checkpoint", ck, "--temperature", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    latin = subprocess.run([*run, "--prompt", b"caf\xe9", "--max-tokens", "4"], cwd=REPO, capture_output=True,
                           timeout=120, env=env)
    assert latin.returncode == 0 and latin.stdout.startswith(b"caf\xe9"), latin
    text = latin.stdout[4:8]  # 4 tokens of 1 byte; then a newline unless the text ended its line
    assert latin.stdout[8:] == (b"" if text.endswith(b"\n") else b"\n"), latin.stdout
    first = subprocess.run([*run, "--prompt", "ab\n", "--max-tokens", "1"], cwd=REPO, capture_output=True,
                           timeout=120, env=env).stdout[3:4]  # the greedy first token, a character
    stopped = subprocess.run([*run, "--prompt", "ab\n", "--stop", first.decode()], cwd=REPO, capture_output=True,
                             timeout=120, env=env)
    assert (stopped.returncode, stopped.stdout) == (0, b"ab\n"), stopped  # nothing generated: the prompt's line


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "temperature"), (["--top-p", "0"], "--top-p"), (["--max-tokens", "0"], "--max-tokens"),
    (["--prompt", ""], "nothing to"),
    # the request's checks had said these, in the API's words ("seed must be ...", "stop must be ... a list"), and
    # --mem-len 0, in range by --help, was refused after the model loaded (found by a helper)
    (["--seed", "9" * 23], "generate: error: argument --seed: expected a whole number from -"),
    (["--stop", ""], "generate: error: argument --stop: expected a string of one character or more"),
    (["--mem-len", "0"], "generate: error: argument --mem-len: expected a whole number from 1 to"),
    (["--repetition-penalty", "0"], "generate: error: argument --repetition-penalty: expected a number above 0"),
    (["--frequency-penalty", "3"], "generate: error: argument --frequency-penalty: expected a number from -2"),
    (["--min-tokens", "999"], "--min-tokens 999 is past --max-tokens 200"),
])
def test_generate_bad_input_one_line(checkpoint, flags, needle, capsys):
    """In this process (an exception let through would fail the test with its traceback): the parser's refusals
    exit 2, the command's own return 2; either way one line."""
    import torch

    from server.cli import main

    threads = torch.get_num_threads()
    try:
        code = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "x", *flags])
    except SystemExit as stop:
        code = stop.code
    finally:
        torch.set_num_threads(threads)  # the command sets its own
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err


def test_generate_refuses_a_memory_that_cannot_fit_in_one_line(checkpoint, capsys, monkeypatch):
    """A mem_len past this host's memory was a process killed mid-allocation with no message; the host's free
    memory is read from /proc/meminfo (the seam set here to 8 MiB, which this small model at mem_len 1,000,000
    exceeds, as the bundled model's 1,048,576 exceeds a 24 GiB host)."""
    import torch

    import model.decode
    from server.cli import main

    assert model.decode.available_bytes(torch.device("cpu")) > 0  # read on this (Linux) host
    monkeypatch.setattr(model.decode, "available_bytes", lambda device: 8 << 20)
    threads = torch.get_num_threads()
    try:
        code = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--mem-len", "1000000"])
        assert code == 2
        err = capsys.readouterr().err
        assert "mem_len 1,000,000 needs at least" in err and "and 8.0 MiB is available" in err and err.count("\n") == 1
        assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--mem-len", "64",
                     "--max-tokens", "2"]) == 0  # what fits still runs
    finally:
        torch.set_num_threads(threads)


def test_bench_decode_json(checkpoint):
    r = txlserve("bench", "decode", "--checkpoint", str(checkpoint), "--mem-len", "16", "--batch", "2",
                 "--tokens", "4", "--json", "--threads", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("tokens_per_s", "baseline_tokens_per_s", "speedup", "prefill_tokens_per_s", "device"):
        assert out[key]
    assert out["mem_len"] == 16 and out["batch"] == 2
    assert out["speedup"] == pytest.approx(out["tokens_per_s"] / out["baseline_tokens_per_s"])
    # the roofline: bytes a step reads over its time over the bandwidth measured in the same run
    for key in ("bytes_per_step", "read_bandwidth_gb_s", "roofline_share", "reference_prefill_tokens_per_s"):
        assert out[key] > 0
    assert out["roofline_share"] == pytest.approx(
        out["bytes_per_step"] / (out["step_ms"] / 1000) / (out["read_bandwidth_gb_s"] * 1e9), rel=1e-6)
    # and against a buffer of the step's own size read again and again (the limit where those bytes fit a cache)
    assert out["warm_read_bandwidth_gb_s"] > 0
    assert out["warm_roofline_share"] == pytest.approx(
        out["bytes_per_step"] / (out["step_ms"] / 1000) / (out["warm_read_bandwidth_gb_s"] * 1e9), rel=1e-6)
    model = load_checkpoint(str(checkpoint)).model  # what a step reads: not r_net, made into the table once
    c = model.cfg
    used = sum(p.nbytes for name, p in model.named_parameters() if ".r_net." not in name)  # embedding tied once
    assert out["bytes_per_step"] == used + 4 * c.n_head * c.d_head * c.n_layer * (2 * 2 * 16 + 17)
    assert out["prefill_speedup"] == pytest.approx(
        out["prefill_tokens_per_s"] / out["reference_prefill_tokens_per_s"], rel=1e-6)
    # on a CPU the step is traced; the same step op by op is timed in the same run
    assert out["traced_step_ms"] == pytest.approx(out["step_ms"], rel=1e-6)
    assert out["traced_speedup"] == pytest.approx(out["eager_step_ms"] / out["traced_step_ms"], rel=1e-6)


def test_prefill_macs_count_what_each_forward_multiplies():
    """By hand for one layer (d_model 2, one head of 1), mem_len 2, a 2-token document in one call: the decoder's
    call attends over the 2-slot ring and itself (4 keys, 3 distances) and scores its last token; the reference's
    segment has no memory yet (2 keys and distances), projects its 2 positions and scores every token."""
    from bench.decode import prefill_macs
    from model.config import TXLConfig

    cfg = TXLConfig(n_layer=1, d_model=2, n_head=1, d_head=1, d_inner=1, tgt_len=2, mem_len=2, vocab_size=1)
    qkv, o_net, ff = 2 * 2 * 3, 2 * 2, 2 * 2 * 2
    assert prefill_macs(cfg, 2, 2, 2) == (qkv + 2 * (2 * 4 + 3) + o_net + ff + 2,
                                          qkv + 2 * 2 + 2 * (2 * 2 + 2) + o_net + ff + 2 * 2)
    paper = TXLConfig(n_layer=6, d_model=256, n_head=4, d_head=64, d_inner=1024, tgt_len=512, mem_len=512)
    ours, ref = prefill_macs(paper, 512, 2048, 128)
    assert 1.3 < ref / ours < 1.45  # the bound on 6 x 256 / 512's prefill speedup at equal speed per MAC
    assert prefill_macs(TXLConfig(cutoffs=[100], vocab_size=300), 8, 16, 4) is None


def test_bench_decode_random_shape():
    r = txlserve("bench", "decode", "--shape", "2x64", "--mem-len", "32", "--batch", "2", "--tokens", "3",
                 "--no-naive", "--threads", "1", "--prefill-tokens", "64")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["n_layer"], out["d_model"], out["checkpoint"]) == (2, 64, "random 2x64")
    assert "speedup" not in out and out["prefill_chunk"] == 256
    from bench.decode import prefill_macs
    from model.config import TXLConfig

    cfg = TXLConfig(n_layer=2, d_model=64, n_head=1, d_head=64, d_inner=256, tgt_len=32, mem_len=32)
    ours, ref = prefill_macs(cfg, 32, 64, 256)  # one 64-token call against two 32-token segments
    assert out["prefill_macs_ratio"] == pytest.approx(ref / ours)


def test_bench_scales_scoring_times_prompt_logprobs_ranks_against_scores_alone(tmp_path):
    """``bench scale``'s scoring figure, on a small model: the scores alone and with ranks, in one run."""
    from bench.scale import measure_scoring
    from tests.model.test_engine import make_engine

    out = measure_scoring(make_engine(tmp_path), 12)
    assert out["scored_tokens"] == 12 and out["score_ms"] > 0 and out["score_with_ranks_ms"] > 0
    assert out["ranks_over_scores"] == pytest.approx(out["score_with_ranks_ms"] / out["score_ms"])


def test_bench_scale_takes_relative_paths_and_says_a_bad_work_dir(checkpoint, tmp_path):
    """A relative --checkpoint (or --work-dir) was not found by the load's timing process, which runs in the
    repository: a traceback. A --work-dir that is no directory was named with the temporary path made inside it."""
    import shutil

    shutil.copytree(checkpoint, tmp_path / "ck")
    (tmp_path / "afile").write_text("")
    common = [sys.executable, "-m", "server.cli", "bench", "scale", "--tokens", "1", "--prefill-tokens", "8",
              "--iters", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([*common, "--checkpoint", "ck"], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["load_s"] > 0
    for flags, said in ((["--work-dir", "afile"], "--work-dir afile is not a directory"),
                        (["--work-dir", "nowhere"], "--work-dir nowhere is not a directory"),
                        (["--checkpoint", "nowhere"], "checkpoint directory nowhere does not exist")):
        r = subprocess.run([*common, *flags], cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
        assert r.returncode == 2 and r.stderr == f"txlserve: error: {said}\n", r.stderr[-2000:]


def test_bench_store_json(checkpoint):
    r = txlserve("bench", "store", "--json", "--iters", "3", "--state-mb-large", "1", "--state-mb-small", "0.05",
                 "--checkpoint", str(checkpoint), "--doc-kb", "2", "--threads", "2", timeout=180)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["threads"] == 2  # restore against recompute at --threads, not the default (OMP_NUM_THREADS 1 here)
    for key in ("restore_ms", "recompute_ms", "restore_speedup"):
        assert out[key] > 0
    assert out["large"]["put"]["p50_ms"] > 0 and out["small"]["get_hot"]["p99_ms"] > 0
    assert out["doc_bytes"] == 2000
    large = out["large"]
    assert large["append_tokens"] == min(64, large["shape"][1] // 2) and large["appended_speedup"] == pytest.approx(
        large["commit_whole"]["p50_ms"] / large["commit_appended"]["p50_ms"])


def test_bench_serve_json(checkpoint):
    r = txlserve("bench", "serve", "--checkpoint", str(checkpoint), "--concurrency", "2", "--duration", "0.3",
                 "--rounds", "2", "--max-tokens", "8", "--random-range-ratio", "0.5", "--doc-kb", "1",
                 "--stream-interval", "3", "--api-server-count", "2", "--client-processes", "2", "--scored-kb", "2",
                 "--batch-prompts", "3", "--batch-prompt-chars", "400", "--samples", "3",
                 "--sample-prompt-chars", "300", "--sample-tokens", "4", timeout=180)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [load["concurrency"] for load in out["loads"]] == [2] and out["model"] == "bench-model"  # one load (the
    # suite's time): a list of them is the parser's, below
    assert out["overlap_schedule"] is True  # the default; on a CPU's table it changes nothing
    # a spawned server of two API servers, both answering before the load began; the load's two streams each in a
    # process of its own (one stream: one process)
    assert out["server_api_server_count"] == 2 and out["server_workers"] == 1 and out["client_processes"] == 2
    assert out["stream_interval"] == out["server_stream_interval"] == 3  # the engine loop's and the server's
    assert out["rounds"] == 2 and out["random_range_ratio"] == 0.5 and out["max_tokens_range"] == [4, 12]
    from bench.serve import _counts

    assert _counts("1,16,64") == (1, 16, 64)
    for load in out["loads"]:
        assert load["errors"] == 0 and load["requests"] >= load["concurrency"] and load["tokens_per_s"] > 0
        # each request asked for its own length within the range, and the server's usage says it got it
        assert 4 * load["requests"] <= load["requested_tokens"] <= 12 * load["requests"]
        assert load["completion_tokens"] == load["requested_tokens"]
        assert 0 < load["tokens"] <= load["completion_tokens"]  # the events that arrived within the window
        assert load["ttft_p50_ms"] > 0 and load["server_over_engine"] == pytest.approx(
            load["tokens_per_s"] / load["engine_tokens_per_s"])
        rounds = load["server_over_engine_rounds"]  # each round's load against the engine slices beside it
        assert len(rounds) == 2 and all(x > 0 for x in rounds) and load["duration_s"] == pytest.approx(0.3)
        assert load["server_over_engine_median"] == pytest.approx(sum(rounds) / 2)
        # the engine loop alone (no HTTP, no store) sits between the two: its figure splits the ratio in two
        assert len(load["engine_loop_over_engine_rounds"]) == 2 and load["engine_loop_tokens_per_s"] > 0
        assert load["engine_loop_over_engine"] == pytest.approx(
            load["engine_loop_tokens_per_s"] / load["engine_tokens_per_s"])
        assert load["server_over_engine_loop"] * load["engine_loop_over_engine"] == pytest.approx(
            load["server_over_engine"])
        # the engine waking a waiting thread once a step: the floor of any hand-off, timed in the same rounds
        assert len(load["engine_wakeup_over_engine_rounds"]) == 2 and load["engine_wakeup_tokens_per_s"] > 0
        assert load["engine_wakeup_over_engine"] == pytest.approx(
            load["engine_wakeup_tokens_per_s"] / load["engine_tokens_per_s"])
        # where each engine loop's steps went over the windows (the server's from its /metrics, read by one of
        # the load's processes): every phase, the rows a step generated for, and how much of it ran on a CPU
        for loop in ("server_engine_loop", "engine_loop"):
            phases = load[f"{loop}_phase_us_per_step"]
            assert tuple(phases) == PHASES and phases["forward"] > 0 and load[f"{loop}_steps_per_s"] > 0
            assert 0 < load[f"{loop}_tokens_per_step"] <= load["concurrency"] + 0.5, loop
            assert 0 < load[f"{loop}_cpu_share"] <= 1.1, loop
        # where the server's requests' time went (its /metrics): each lifecycle phase's mean, inside a request's
        request_ms = load["server_request_ms"]
        assert set(request_ms) == {"start", "engine", "export", "handoff", "commit", "ttft", "e2e"}, request_ms
        assert request_ms["engine"] > 0 and request_ms["ttft"] <= request_ms["e2e"]
    assert out["continue_speedup"] > 0
    batch = out["batch_scored"]  # 3 prompts scored in one request, one by one, and all at once
    assert (batch["prompts"], batch["prompt_chars"], batch["prompt_tokens"]) == (3, 400, 3 * 400)  # a byte model
    assert batch["max_logprob_diff"] < 1e-4 and batch["batch_s"] > 0 and batch["batch_over_sequential"] > 0
    samples = out["samples"]  # one request of n 3 against 3 requests at once, their texts checked to agree
    assert (samples["n"], samples["prompt_chars"], samples["prompt_tokens"], samples["max_tokens"]) == (3, 300, 300, 4)
    assert samples["n_s"] > 0 and samples["n_over_concurrent"] > 0
    scored = out["scored_beside_streams"]  # a long prompt scored beside 4 streams, and those streams alone
    assert scored["prompt_tokens"] >= 2000 and scored["logprobs"] == 20 and scored["response_bytes"] > 2000 * 20 * 8
    for side in ("beside", "alone"):
        assert scored[side]["health_probes"] > 0 and scored[side]["itl_max_ms"] >= scored[side]["itl_p99_ms"] > 0
    beside, alone = scored["beside"], scored["alone"]
    assert scored["health_max_ratio"] == pytest.approx(beside["health_max_ms"] / alone["health_max_ms"])
    poll = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")  # the host's idle polling, where it says
    assert out["guest_halt_poll_ns"] == (int(poll.read_text()) if poll.exists() else None)


def test_bench_serve_reads_no_engine_loop_from_a_metrics_page_that_is_not_prometheus():
    """``bench serve --url`` at a server whose /metrics is something else (HTML, or a 404): its engine loop is
    unknown, not an error after the load's warm-up."""
    import http.server
    import threading

    from bench.serve import LoopTime

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = b"<html><body>{not: prometheus}</body></html>"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{httpd.server_address[1]}"
            assert LoopTime.scrape(url) is None and LoopTime.scrape(url + "/elsewhere") is None
        finally:
            httpd.shutdown()
            thread.join(10)


def test_bench_startup_json(checkpoint, capsys):
    from server.cli import main  # in this process: the servers and imports it times are processes of their own

    assert main(["bench", "startup", "--checkpoint", str(checkpoint), "--repeats", "1", "--json", "--",
                 "--no-engine-process"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["server_args"] == ["--no-engine-process"] and len(out["ready_s"]) == len(out["torch_import_s"]) == 1
    # a server imports torch and more before it answers, but one repeat on a busy machine can make either the
    # slower (a bare import took 2.01 s, the server's start 1.82 s, with other processes on both cores)
    assert out["ready_s_median"] > 0 and out["torch_import_s_median"] > 0
    assert out["ready_over_torch_import"] == pytest.approx(out["ready_s_median"] / out["torch_import_s_median"])


def _refused(capsys, *argv: str) -> str:
    """The CLI's own parser, in this process (a subprocess per case cost 3 s of imports): exit 2 and its line."""
    from server.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_bench_serve_refuses_bad_flags(capsys):
    assert "--rounds: expected a whole number from 1 up" in _refused(capsys, "bench", "serve", "--rounds", "0")
    for flag in ("--stream-interval", "--workers", "--api-server-count", "--client-processes"):
        assert f"{flag}: expected a whole number from 1 up" in _refused(capsys, "bench", "serve", flag, "0")
    for ratio in ("1", "-0.1", "x"):
        assert "--random-range-ratio: expected a number" in _refused(
            capsys, "bench", "serve", "--random-range-ratio", ratio)


def test_a_file_that_cannot_be_read_or_written_is_named_as_cat_names_it(tmp_path, capsys):
    """``PATH: reason``; it was Python's ``[Errno 2] No such file or directory: 'PATH'`` (found by a helper)."""
    from server.cli import main

    missing = tmp_path / "nowhere" / "export.json"
    assert main(["session", "import", str(missing), "--url", "http://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err == f"txlserve: error: {missing}: No such file or directory\n"
    import errno

    from server.cli import _os_error
    assert _os_error(OSError(errno.EXDEV, "Invalid cross-device link", "a.tmp", None, "b")) == (  # a rename's two
        "a.tmp -> b: Invalid cross-device link")
    assert _os_error(OSError("no path at all")) == "no path at all"


def test_bench_store_tiers_names_every_form_it_takes(capsys):
    """It named the LxD form alone, not the bundled and wt103 it takes as well (found by a helper)."""
    err = _refused(capsys, "bench", "store", "--tiers", "bundled,bogus")
    assert "--tiers: expected bundled, wt103 or LAYERSxD_MODEL such as 12x512" in err and "got 'bogus'" in err, err
    from bench.tiers import _tiers

    assert _tiers("Bundled,WT103,2x64") == "bundled,wt103,2x64"  # in any case, as LxD was


def test_bench_serve_says_why_its_server_did_not_start(checkpoint, tmp_path):
    """A spawned server that exits shows its status and its own last lines (on a GPU machine it was a missing
    package), at once rather than after the start-up deadline."""
    from bench.serve import _Server
    from txlserve.errors import ConfigError

    with pytest.raises(ConfigError) as err:  # one line, as every error of the CLI (it was a traceback)
        _Server(str(checkpoint), str(tmp_path), ["--max-batch", "0"])
    message = str(err.value)
    assert "the server exited with 2" in message and "--max-batch must be >= 1" in message and "\n" not in message


def test_bench_serve_lengths_spread_and_repeat():
    """Equal lengths keep the bench's streams in step (they end on one step and turn around as a herd): the
    spread ones differ between requests and streams, stay in range, and repeat with the seed."""
    from bench.serve import Lengths

    same = Lengths(64).stream(0)
    assert {same() for _ in range(50)} == {64}
    spread = Lengths(64, 0.5, seed=3)
    assert spread.bounds == (32, 96)
    a, b = spread.stream(0), spread.stream(1)
    drawn_a, drawn_b = [a() for _ in range(200)], [b() for _ in range(200)]
    assert all(32 <= n <= 96 for n in drawn_a + drawn_b) and len(set(drawn_a)) > 20 and drawn_a != drawn_b
    again = spread.stream(0)
    assert [again() for _ in range(200)] == drawn_a
    assert Lengths(1, 0.9).bounds == (1, 2)  # never a length of 0


def test_bench_serve_timers_warm_up_untimed(checkpoint):
    """The first steps trace and profile the step's graph (a first half second at batch 1 read 808 against 1,040
    tokens/s): the engine alone and the engine loop each run one request per session before their clocks start,
    as the load does, so no round's figure carries that cost."""
    from bench.serve import PROMPT, EngineAlone, EngineLoop

    alone = EngineAlone(str(checkpoint), 2, tokens=5, device="cpu")
    assert (alone.generated, alone.elapsed) == (0, 0.0)
    assert alone.state.seen.tolist() == [alone.engine.mem_len + 5] * 2  # the memory, then one untimed request
    loop = EngineLoop(alone, PROMPT)
    try:
        assert (loop.generated, loop.elapsed) == (0, 0.0)
        prompt = len(alone.engine.encode(PROMPT))
        assert [int(s.seen[0]) for s in loop.states] == [alone.engine.mem_len + 5 + prompt + 5] * 2
        loop.run(0)  # a timed run of no length still finishes a request per session
        assert loop.generated == 2 * 5 and loop.elapsed > 0
    finally:
        loop.close()


def test_chat_subcommand_hands_every_flag_to_the_client():
    r = txlserve("chat", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: txlserve chat " in r.stdout and "--session" in r.stdout


def test_start_up_objects_are_frozen_out_of_the_collectors_reach():
    """A full collection walked everything start-up made (modules, the model, the app), holding the GIL for
    80-180 ms while every stream waited: serve freezes those objects before it takes requests."""
    import gc

    from server.serve import freeze_startup_objects

    made_at_start_up = [["a container the collector tracks"]]
    assert any(o is made_at_start_up for o in gc.get_objects())
    try:
        # at most as many are frozen a moment later: the suite's other threads free frozen objects meanwhile (two
        # did once under load), and objects made since go to the young generation, never the frozen one
        assert freeze_startup_objects() >= gc.get_freeze_count() > 0
        assert not any(o is made_at_start_up for o in gc.get_objects())  # no generation holds it any more
    finally:
        gc.unfreeze()


_STOP_BEFORE_SERVING = """
import signal, sys
sys.path.insert(0, {repo!r})
import server.serve as serve_mod
freeze, make = serve_mod.freeze_startup_objects, serve_mod._Server.__init__
def stop_then_freeze():  # the signal lands after the runtime opened, before uvicorn's handlers are in
    signal.raise_signal(signal.Signals[sys.argv[1]])
    return freeze()
def make_then_stop(self, *args):  # it lands while the server is made, before it takes the signals
    make(self, *args)
    signal.raise_signal(signal.Signals[sys.argv[1]])
if sys.argv[2] == "freeze":
    serve_mod.freeze_startup_objects = stop_then_freeze
else:
    serve_mod._Server.__init__ = make_then_stop
from server.cli import main
sys.exit(main(["serve", "--port", "0", *sys.argv[3:]]))
"""


def test_a_stop_signal_before_serving_closes_the_runtime_quietly(checkpoint, tmp_path):
    """Ctrl-C or SIGTERM after the runtime opened and before uvicorn took the signals: a Ctrl-C there logged
    uvicorn's lifespan traceback (its start-up task cancelled), a SIGTERM killed the process with the runtime
    open, its embedded Redis left running. Now either stops the server before it serves: the runtime closes
    (the embedded Redis this process started stops) and the process exits as after a drain (130, SIGTERM)."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    script = tmp_path / "stop_before_serving.py"
    script.write_text(_STOP_BEFORE_SERVING.format(repo=str(REPO)))

    def run(case: tuple[str, str]) -> tuple[subprocess.CompletedProcess, Path]:
        sig, hook = case
        data = tmp_path / f"{sig}-{hook}"
        return subprocess.run([sys.executable, str(script), sig, hook, "--checkpoint", str(checkpoint),
                               "--data-dir", str(data)], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}), data

    # "server": the signal lands while uvicorn's server is made, after the check for a held one; it was held
    # until that server stopped for another reason, and the server served on. Two cases, one core each: where
    # the signal lands and which signal it is are each covered (a third case cost the suite a whole server).
    cases = [("SIGINT", "freeze"), ("SIGTERM", "server")]
    try:
        with ThreadPoolExecutor(2) as pool:  # two servers side by side, one core each
            runs = list(pool.map(run, cases))
        for (r, data), (name, _) in zip(runs, cases):
            status = 130 if name == "SIGINT" else -signal.SIGTERM
            assert r.returncode == status, r.stderr[-3000:]
            assert f"stopping before serving ({name})" in r.stderr, r.stderr[-3000:]
            assert "Traceback" not in r.stderr and "CancelledError" not in r.stderr, r.stderr[-3000:]
            assert (data / "redis.log").exists() and not (data / "redis.pid").exists()  # started, then stopped
            port = re.search(r"http://127\.0\.0\.1:(\d+)", r.stderr)
            assert port and int(port[1]) > 0, r.stderr[-3000:]  # --port 0: the log names the port it got
    finally:  # a Redis a failing run left behind
        for pidfile in tmp_path.glob("*/redis.pid"):
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pidfile.read_text()), signal.SIGTERM)


@pytest.mark.parametrize("content, needle", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                             ("not json", "is not a JSON export document"),
                                             (b"\xff\xfe{}", "is not a JSON export document"),
                                             ("[1, 2]", "a JSON object (what sessions.export returns), not list"),
                                             ("42", "not int"), ('"ab"', "not str"),
                                             (b"\x80\x04\x95\x05\x00", "is a pickle, which txlserve never loads: "
                                              "session import reads the JSON document `txlserve session export`"),
                                             (b"PK\x03\x04", "is a pickle")])  # (a pickle had been "not UTF-8")
def test_session_import_refuses_a_bad_file_in_one_line(tmp_path, content, needle):
    path = tmp_path / "doc.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    done = txlserve("session", "import", str(path), "--url", "http://127.0.0.1:9", timeout=60)  # read first
    assert done.returncode == 2 and needle in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr  # one line (a RecursionError's was 1000)


def test_session_import_reads_a_bom_from_stdin_as_from_a_file(tmp_path):
    """A file's byte order mark was skipped, stdin's read as part of the JSON ("not a JSON export document")."""
    done = subprocess.run([sys.executable, "-m", "server.cli", "session", "import", "-", "--url", "http://127.0.0.1:9"],
                          cwd=REPO, input=b"\xef\xbb\xbf{}", capture_output=True, timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 2 and "JSON" not in err and "127.0.0.1:9" in err, err  # read; the server is not there


def test_every_flag_of_every_command_says_what_it_does_and_its_default():
    """`--help` listed some flags bare (train's --steps, eval's --split, generate's --seed, bench's --batch ...);
    most of the benchmarks' flags, and a few others (generate's --top-p, every --device), gave no default."""
    import argparse

    import server.cli as cli

    bare, silent = [], []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        text = re.sub(r"\n {10,}", " ", parser.format_help())  # each flag's help on one line
        helps = {line.split()[0].rstrip(","): line for line in text.splitlines() if line.startswith("  -")}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif action.option_strings and not action.help and action.dest != "help":
                bare.append(f"{path} {action.option_strings[0]}")
            elif action.option_strings and not (action.default is None or action.default is False or action.default
                                                in ((), [], argparse.SUPPRESS)) and not (
                    "default" in helps[action.option_strings[0]] or path.endswith((" chat", " bench"))):
                silent.append(f"{path} {action.option_strings[0]} ({action.default!r})")

    walk(cli.build_parser(with_bench=True), "txlserve")
    assert bare == [] and silent == []
    text = cli.build_parser(with_bench=True)._subparsers._group_actions[0].choices["bench"]
    serve = text._subparsers._group_actions[0].choices["serve"].format_help()
    assert "(default: 1,16,64)" in re.sub(r"\s+", " ", serve)  # as it is typed, not a tuple's repr


def test_bench_decode_takes_a_shape_or_a_checkpoint_not_both(capsys):
    import server.cli as cli

    assert cli.main(["bench", "decode", "--shape", "2x64", "--checkpoint", "somewhere"]) == 2  # the shape had won
    err = capsys.readouterr().err
    assert err == "txlserve: error: give --shape (random weights) or --checkpoint, not both\n"


@pytest.mark.parametrize("code", [0, 3])
def test_leaving_without_finalizing_still_fails_when_its_output_is_lost(code):
    """train, eval, generate, import and the engine process end with ``leave_without_finalizing``: output it could
    not write (a full disk) is a failure, status 120 as Python's own exit gives, never a success with the JSON
    gone; its own status otherwise, and its output flushed."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    program = ("from server.leave import leave_without_finalizing; print('{\"ok\": 1}'); "
               f"leave_without_finalizing({code})")
    env = {**os.environ, "PYTHONUNBUFFERED": ""}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-c", program], cwd=REPO, stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=60, env=env)
    assert r.returncode == (code or 120) and "could not be written" in r.stderr, (r.returncode, r.stderr)
    r = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == code and r.stdout == '{"ok": 1}\n', (r.returncode, r.stdout)


def test_a_ctrl_c_while_leaving_is_ignored():
    """A second Ctrl-C that landed in ``logging.shutdown``'s lock waits, as a stopped ``train`` left, printed a
    KeyboardInterrupt traceback (1 run in ~22 of a helper's). Here a log handler's flush presses it itself."""
    program = """if True:
        import logging, os, signal
        from server.leave import leave_without_finalizing

        class Pressing(logging.Handler):
            def emit(self, record): pass
            def flush(self):
                os.kill(os.getpid(), signal.SIGINT)
                sum(range(10000))  # the interpreter checks its signals here

        logging.getLogger().addHandler(Pressing())
        print("saved")
        leave_without_finalizing(130)
    """
    r = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (130, "saved\n", "")


def test_a_ctrl_c_that_an_import_wrapped_in_a_runtime_error_exits_130_without_a_traceback(monkeypatch):
    """Python wraps an interrupt raised in ``__set_name__`` (as ``import torch`` makes its classes) in a
    RuntimeError; the command re-raised it, a traceback and exit 1 for a Ctrl-C (found by a helper)."""
    import argparse

    from server import cli

    def interrupted_import(ns: argparse.Namespace) -> int:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("Error calling __set_name__ on 'cached_property' instance 'guard_source'") from None

    def fails(ns: argparse.Namespace) -> int:
        raise RuntimeError("a bug")

    for func, want in ((interrupted_import, 130), (fails, None)):
        parser = argparse.ArgumentParser()
        parser.set_defaults(func=func)
        monkeypatch.setattr(cli, "build_parser", lambda with_bench=False, parser=parser: parser)
        if want is None:
            with pytest.raises(RuntimeError, match="a bug"):  # any other RuntimeError is still a bug's traceback
                cli._main([])
        else:
            assert cli._main([]) == want


@pytest.mark.parametrize("raised", [KeyboardInterrupt, RuntimeError])
def test_a_ctrl_c_while_the_benchmarks_parsers_import_torch_exits_130(monkeypatch, raised):
    """``bench``'s parsers import their modules, and torch with them, before the command's own try: a Ctrl-C in
    its first second printed a KeyboardInterrupt traceback (found by a helper)."""
    from server import cli

    def importing(with_bench: bool = False):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            if raised is KeyboardInterrupt:
                raise
            raise RuntimeError("Error calling __set_name__ on 'cached_property' instance 'x'") from None

    monkeypatch.setattr(cli, "build_parser", importing)
    assert cli._main(["bench", "decode"]) == 130


@pytest.mark.parametrize("argv, says", [
    (("generate", "--prompt", "hi", "--clamp-len", str(10**20)), "--clamp-len: expected a whole number"),
    (("bench", "decode", "--clamp-len", str(10**20)), "--clamp-len: expected a whole number"),
    (("train", "--data", "x", "--out", "y", "--lr", "1e308"), "--lr: expected a number above 0 to 10"),
    (("train", "--data", "x", "--out", "y", "--weight-decay", "1e308"), "--weight-decay: expected a number from 0"),
    (("train", "--data", "x", "--out", "y", "--seed", str(10**20)), "--seed: expected a whole number"),
])
def test_numbers_past_what_torch_holds_are_refused_by_the_parser(capsys, argv, says):
    """Each was a traceback (OverflowError from a position, Adam's "cannot be converted to type float without
    overflow", "Overflow when unpacking long long"; found by a helper)."""
    assert says in _refused(capsys, *argv)


@pytest.mark.parametrize("argv, says", [
    (("--mem-len", "32", "--no-naive", "--batch", "10000000"), "10,000,000 sessions of mem_len 32 .* need at least"),
    (("--shape", "64x65536"), "a random 64x65536 model's weights .* need at least"),
])
def test_bench_decode_refuses_what_cannot_fit_before_allocating(capsys, argv, says):
    """--batch 30000 and --shape 64x8192 were the kernel's OOM kill: exit 137 and no word (found by a helper)."""
    from server.cli import main

    assert main(["bench", "decode", *argv]) == 2
    assert re.search(says, capsys.readouterr().err)

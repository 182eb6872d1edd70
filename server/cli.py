"""The `txlserve` command. Each subcommand imports only what it needs, so
`txlserve train` never loads the web stack."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from model.config import CLAMP_LEN_MOST, MEM_LEN_MOST, TRAIN_MOST
from txlserve import json_out
from txlserve.args import MAX_THREADS, count, device, real
from txlserve.errors import ConfigError, DataError, TxlError
from txlserve.pickles import looks_pickled

MEM = count(0, MEM_LEN_MOST)  # a memory length, as serve bounds it


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=count(1, MAX_THREADS), default=None,  # TXLSERVE_THREADS: _set_threads
                   help="torch CPU threads [TXLSERVE_THREADS] (default: half the usable cores, at least 1)")


def _set_threads(ns: argparse.Namespace) -> None:
    import os

    threads = ns.threads  # the flag's range is its parser's (_add_threads)
    if threads is None and (raw := os.environ.get("TXLSERVE_THREADS")):
        if not raw.isdigit():
            raise ConfigError(f"TXLSERVE_THREADS={raw!r} is not a whole number")
        threads = int(raw)
        if not 1 <= threads <= MAX_THREADS:  # 100,000 crashed torch's thread pool (SIGSEGV)
            raise ConfigError(f"TXLSERVE_THREADS must be from 1 to {MAX_THREADS}, got {threads}")
    from model.threads import set_threads  # imports torch: only once the flags are known to be good

    set_threads(threads)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a Transformer-XL and write a checkpoint")
    p.add_argument("--data", default=None, help="enwik8/text8 (.zip, .gz or raw), a text file (gzipped or not), a "
                                                "folder of .txt, or for --tokenizer word a WikiText folder "
                                                "(required, but with --resume the run's)")
    p.add_argument("--out", required=True, help="checkpoint directory to write: a new or empty one, or with --resume "
                                                "the checkpoint to continue")
    p.add_argument("--preset", default="tiny", help="tiny | small | enwik8-base (default: tiny)")
    for flag, typ, says in (
            ("--steps", count(1), "optimizer steps in all"), ("--batch-size", count(1),
                                                                 "sequences a step (under torchrun, each process's)"),
            ("--lr", real(0, TRAIN_MOST["lr"], above=True),
             f"peak learning rate (cosine decay after the warm-up; at most {TRAIN_MOST['lr']})"),
            ("--warmup-steps", count(0), "steps of linear warm-up"),
            ("--tgt-len", count(1), "tokens a segment (the paper's tgt_len)"),
            ("--mem-len", MEM, "cached layer inputs a layer attends beyond the segment (mem_len)"),
            ("--n-layer", count(1), "layers"),
            ("--d-model", count(1), "model width; d_inner becomes 4 x it and d_head it / n_head"),
            ("--eval-every", count(0), "steps between validation runs (0: none)"),
            ("--clip", real(0, above=True), "gradient norm clip")):
        p.add_argument(flag, type=typ, default=None, help=f"{says} (default: the preset's; with --resume, the run's)")
    p.add_argument("--eval-tokens", type=count(1), default=200_000,
                   help="valid tokens (bytes, or words for a word model) an evaluation reads (default: 200000)")
    p.add_argument("--save-every", type=count(0), default=0,
                   help="also save the checkpoint and training state every N steps (0: never between; a run "
                        "always saves at its end and on Ctrl-C)")
    p.add_argument("--save-best", action="store_true",
                   help="also write the model to OUT/best at each evaluation that lowers the valid bpc (long runs "
                        "on small corpora overfit: keep the best weights, as nanoGPT does); needs evaluations: "
                        "--eval-every, or a preset that has them")
    p.add_argument("--grad-accum", type=count(1), default=1,
                   help="micro-batches a step (the batch split N ways; default: 1)")
    p.add_argument("--weight-decay", type=real(0, TRAIN_MOST["weight_decay"]), default=0.0,
                   help=f"AdamW weight decay (default: 0; at most {TRAIN_MOST['weight_decay']})")
    p.add_argument("--seed", type=count(0, TRAIN_MOST["seed"]), default=1111,
                   help="seed of the weights' initialisation and dropout (default: 1111)")
    p.add_argument("--device", type=device, default="auto", help="auto | cpu | cuda")
    p.add_argument("--resume", action="store_true",
                   help="continue from the training state in --out, with the run's data and settings where this "
                        "command line gives none")
    p.add_argument("--stop-at", type=count(1), default=None, help="end this run at that step; --resume continues")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (metrics.jsonl is written anyway)")
    p.add_argument("--tokenizer", default="byte", choices=["byte", "word"],
                   help="byte: any text; word: a WikiText-style folder (wiki.train.tokens ...), vocabulary built "
                        "from its train split in frequency order")
    p.add_argument("--max-vocab", type=count(1), default=None,
                   help="word: keep the most frequent words (others <unk>)")
    p.add_argument("--min-freq", type=count(1), default=1, help="word: drop words seen fewer times")
    p.add_argument("--cutoffs", type=_int_list, default=None,
                   help="adaptive softmax cluster boundaries, e.g. 20000,40000,200000 (word models)")
    p.add_argument("--div-val", type=count(1), default=None, help="adaptive embedding width divisor per cluster")
    p.add_argument("--d-embed", type=count(1), default=None,
                   help="embedding width before projection (default d_model)")
    _add_threads(p)
    p.set_defaults(func=_cmd_train, parser=p)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> frozenset[str]:
    """The destinations ``argv`` sets (argparse fills a default only into a namespace that lacks the name, so
    parsing into one prefilled with a marker leaves the marker where a flag was not given)."""
    unset = object()
    probe = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.option_strings})
    parser.parse_args(argv, namespace=probe)
    return frozenset(k for k, v in vars(probe).items() if v is not unset)


def _cmd_train(ns: argparse.Namespace) -> int:
    if ns.data is None and not ns.resume:
        raise ConfigError("train needs --data (with --resume, the run's is taken)")
    _set_threads(ns)
    from model.train import TrainArgs, train

    given = _given(ns.parser, ns.argv[1:])  # argv[0] is "train"
    if given & {"cutoffs", "div_val", "d_embed"}:
        given |= {"model_overrides"}
    args = TrainArgs(  # the data's path as the run keeps it: absolute, so a --resume from elsewhere finds it
        data=None if ns.data is None else os.path.abspath(ns.data), out=ns.out, preset=ns.preset, steps=ns.steps,
        batch_size=ns.batch_size, lr=ns.lr,
        warmup_steps=ns.warmup_steps, tgt_len=ns.tgt_len, mem_len=ns.mem_len, n_layer=ns.n_layer,
        d_model=ns.d_model, eval_every=ns.eval_every, eval_tokens=ns.eval_tokens, save_every=ns.save_every,
        save_best=ns.save_best,
        grad_accum=ns.grad_accum, clip=ns.clip, weight_decay=ns.weight_decay, seed=ns.seed, device=ns.device,
        resume=ns.resume, stop_at=ns.stop_at, progress=not ns.no_progress, command="txlserve " + shlex.join(ns.argv),
        tokenizer=ns.tokenizer, max_vocab=ns.max_vocab, min_freq=ns.min_freq,
        model_overrides={k: v for k, v in (("cutoffs", ns.cutoffs), ("div_val", ns.div_val),
                                           ("d_embed", ns.d_embed)) if v is not None}, given=given,
    )
    result = train(args)
    summary = {k: v for k, v in result.items() if k != "losses"}
    summary["final_loss"] = result["losses"][-1] if result["losses"] else None
    if os.environ.get("RANK", "0") == "0":  # the run's, once: every rank printed it (found by a helper)
        if summary["final_loss"] is not None and not math.isfinite(summary["final_loss"]):
            print("txlserve: warning: the loss is not a number: the run diverged and its weights are not numbers "
                  "either (lower --lr or --weight-decay)", file=sys.stderr)
        print(json_out.dumps(summary))
    return 0  # a torchrun worker then leaves without Python's teardown, which gloo's threads can abort (main)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="bits per character (byte models) or word perplexity (word models) of a "
                                    "checkpoint on a corpus split")
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory")
    p.add_argument("--data", required=True, help="a byte corpus, or for word models a WikiText folder or file")
    p.add_argument("--split", default="test", choices=["train", "valid", "test", "all", "whole"],
                   help="default: test; all: each split in turn (those a word folder has); whole: every token of "
                        "--data in order, as one text (a held-out file scored entire, where a byte corpus's file is "
                        "otherwise split 90/5/5)")
    p.add_argument("--tgt-len", type=count(1), default=None, help="tokens a segment (default: the checkpoint's)")
    p.add_argument("--mem-len", type=MEM, default=None, help="default: the checkpoint's")
    p.add_argument("--clamp-len", type=count(0, CLAMP_LEN_MOST), default=None,
                   help="relative distances clamped to this (0: none; default: the checkpoint's)")
    p.add_argument("--same-length", action=argparse.BooleanOptionalAction, default=None,
                   help="every token attends the same number of keys (default: the checkpoint's); with "
                        "--batch-size 1 the scores are the server's (an append's logprob), whose window is always "
                        "this one, at any --tgt-len")
    p.add_argument("--batch-size", type=count(1), default=8,
                   help="streams the split is cut into (default: 8; fewer where it holds less than a segment each, "
                        "and the output's batch_size says how many)")
    p.add_argument("--max-tokens", type=count(1), default=None,
                   help="evaluate the first N tokens of the split (cut into --batch-size streams, as the paper "
                        "evaluates: fewer than two tokens a stream go unscored; the output's tokens counts those "
                        "scored)")
    p.add_argument("--device", type=device, default="auto", help="auto | cpu | cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (shown on a terminal's stderr: scoring a whole file can take minutes)")
    _add_threads(p)
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(ns: argparse.Namespace) -> int:
    _set_threads(ns)
    import numpy as np
    from tqdm import tqdm

    from model.checkpoint import load_checkpoint
    from model.data import load_corpus
    from model.evaluate import evaluate
    from model.train import pick_device

    device = pick_device(ns.device)
    overrides = {k: v for k, v in (("mem_len", ns.mem_len), ("clamp_len", ns.clamp_len),
                                    ("same_length", ns.same_length)) if v is not None}
    ckpt = load_checkpoint(ns.checkpoint, device=device, **overrides)
    cfg = ckpt.config
    tgt_len = ns.tgt_len or cfg.tgt_len
    splits = ["train", "valid", "test"] if ns.split == "all" else [ns.split]
    parts = ["train", "valid", "test"] if ns.split == "whole" else splits  # whole: the three in order, as one
    if ckpt.tokenizer.name == "word":
        from pathlib import Path

        from model.words import load_word_corpus, split_path

        if Path(ns.data).expanduser().is_file():  # a file stands for every split: read once, as itself (--split
            splits, parts = ["whole"], ["test"]  # all printed the one file's figures three times, as three splits)
        elif ns.split in ("whole", "all"):  # a folder's splits, those it has (WikiText-2's held-out files alone)
            parts = [n for n in parts if split_path(ns.data, n)]
            if not parts:
                raise DataError(f"{ns.data} has no split to read (expected wiki.test.tokens, or test.txt, and so on)")
            splits = parts if ns.split == "all" else splits
        corpus, _ = load_word_corpus(ns.data, ckpt.tokenizer, splits=tuple(parts))
    else:
        corpus = load_corpus(ns.data)
    texts = {name: np.concatenate([corpus.split(n) for n in parts]) if name == "whole" else corpus.split(name)
             for name in splits}
    for name, data in texts.items():  # every split checked before any is scored (a late one's hours were lost)
        if len(data) < 2:  # scoring needs a token and the one after it
            raise DataError(f"the {name} split of {ns.data} holds {len(data)} token{'s' * (len(data) != 1)}: "
                            "nothing to score (a token is scored from the one before it)")
        top = int(np.asarray(data).max())
        if top >= cfg.vocab_size:  # a hand-made checkpoint's tokenizer names more symbols than the model reads
            raise DataError(f"the {name} split holds token {top}, past this model's {cfg.vocab_size:,} outputs "
                            "(its checkpoint's tokenizer names more symbols than the model has)")
    results = {}
    for name, data in texts.items():
        total = max(0, min(len(data) - 1, ns.max_tokens or len(data)))
        with tqdm(total=total, unit="tok", unit_scale=True, desc=name, dynamic_ncols=True, leave=False,
                  disable=True if ns.no_progress else None) as bar:  # None: shown on a terminal only
            results[name] = evaluate(ckpt.model, np.asarray(data), tgt_len=tgt_len, batch_size=ns.batch_size,
                                     max_tokens=ns.max_tokens, device=device, scored=bar.update)
    settings = {"checkpoint": str(ns.checkpoint), "data": str(ns.data), "tgt_len": tgt_len, "mem_len": cfg.mem_len,
                "clamp_len": cfg.clamp_len, "same_length": cfg.same_length, "device": str(device)}
    if len(splits) == 1:  # the streams read (fewer than --batch-size where the split is short); else each split's
        settings["batch_size"] = results[splits[0]]["batch_size"]
    if ns.json:
        if len(splits) == 1:
            print(json_out.dumps({**results[splits[0]], "split": splits[0], **settings}))
        else:
            print(json_out.dumps({"splits": results, **settings}))
    else:
        for name, r in results.items():
            if ckpt.tokenizer.name == "word":
                print(f"{name:5s}  ppl {r['ppl']:.4f}  loss {r['loss']:.4f}  words {r['tokens']:,}")
            else:
                print(f"{name:5s}  bpc {r['bpc']:.4f}  ppl {r['ppl']:.4f}  tokens {r['tokens']:,}")
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a continuation of a prompt to the terminal")
    p.add_argument("--checkpoint", default=None, help="default: the bundled checkpoint")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-tokens", type=count(1), default=200, help="tokens to generate at most (default: 200)")
    p.add_argument("--temperature", type=real(0, 2), default=0.8, help="0: greedy (default: 0.8)")
    p.add_argument("--top-k", type=count(0), default=0, help="0: off")
    p.add_argument("--top-p", type=real(0, 1, above=True), default=1.0, help="nucleus sampling (1: off)")
    p.add_argument("--min-p", type=real(0, 1), default=0.0,
                   help="drop tokens less likely than this times the likeliest (vLLM's; 0: off)")
    p.add_argument("--repetition-penalty", type=real(0, above=True), default=1.0,
                   help="divide a positive logit, multiply a negative one, of every token of the prompt or generated "
                        "so far (vLLM's; 1: off)")
    p.add_argument("--frequency-penalty", type=real(-2, 2), default=0.0,
                   help="subtract this times a token's count among those generated (OpenAI's; 0: off)")
    p.add_argument("--presence-penalty", type=real(-2, 2), default=0.0,
                   help="subtract this from every token generated at least once (OpenAI's; 0: off)")
    p.add_argument("--seed", type=count(-(1 << 63), (1 << 63) - 1), default=None,
                   help="the same seed, the same continuation")
    p.add_argument("--stop", type=_stop, action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--min-tokens", type=count(0), default=0,
                   help="generate at least this many tokens before a stop string may end the text (vLLM's; at most "
                        "--max-tokens)")
    p.add_argument("--mem-len", type=count(1, MEM_LEN_MOST), default=None,  # decoding keeps a memory
                   help="default: the checkpoint's")
    p.add_argument("--clamp-len", type=count(0, CLAMP_LEN_MOST), default=None, help="default: the checkpoint's")
    p.add_argument("--device", type=device, default="auto", help="auto | cpu | cuda")
    _add_threads(p)
    p.set_defaults(func=_cmd_generate)


def _stop(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a string of one character or more, got ''")
    return text


def _cmd_generate(ns: argparse.Namespace) -> int:
    _set_threads(ns)
    from model.bundled import resolve_checkpoint
    from model.engine import Engine
    from model.sampling import SamplingParams, after_space
    from model.train import pick_device

    if ns.min_tokens > ns.max_tokens:
        raise ConfigError(f"--min-tokens {ns.min_tokens} is past --max-tokens {ns.max_tokens}")
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_k=ns.top_k, top_p=ns.top_p,
                            seed=ns.seed, stop=tuple(ns.stop), min_p=ns.min_p,
                            repetition_penalty=ns.repetition_penalty, frequency_penalty=ns.frequency_penalty,
                            presence_penalty=ns.presence_penalty, min_tokens=ns.min_tokens,
                            after_space=after_space(ns.prompt))
    engine = Engine.from_checkpoint(resolve_checkpoint(ns.checkpoint), device=pick_device(ns.device),
                                    mem_len=ns.mem_len, clamp_len=ns.clamp_len)
    import asyncio

    from model.engine import TokenEvent
    from server.scheduler import Scheduler

    async def stream() -> None:  # the server's engine loop, one request: one generation loop everywhere
        nonlocal ends_line
        # closed here when a write fails (`| head`): left to the collector, it was "Task was destroyed but it is
        # pending!" at exit
        async with contextlib.aclosing(aiter(scheduler.submit(engine.new_state(), prompt, params))) as events:
            async for item in events:
                if isinstance(item, TokenEvent) and item.text:
                    ends_line = None  # unknown while it is written: a Ctrl-C between the write and the line after
                    sys.stdout.write(item.text)  # it had kept the last piece's answer, and left the line open (CI)
                    sys.stdout.flush()
                    ends_line = item.text.endswith("\n")

    if isinstance(sys.stdout, io.TextIOWrapper):  # a prompt's bytes that are not UTF-8 are echoed as they came
        sys.stdout.reconfigure(errors="surrogateescape")
    # before the prompt is echoed: a word it cannot read is one line alone; a byte model reads the bytes given,
    # UTF-8 or not (they had been refused as "not valid Unicode")
    prompt = engine.encode(os.fsencode(ns.prompt) if engine.tokenizer.name == "byte" else ns.prompt)
    ends_line: bool | None = ns.prompt.endswith("\n")
    # the loop is made before anything is written: a Ctrl-C that landed while asyncio.run made it (after the echo)
    # printed a half-made loop's traceback at exit
    loop = asyncio.new_event_loop()
    scheduler = Scheduler(engine, max_batch=1, prefill_chunk=engine.prefill_chunk)
    scheduler.start()
    task = None
    try:  # the echo too: a write that fails (a full disk) left the engine's thread running, and an abort at exit
        sys.stdout.write(ns.prompt)
        task = loop.create_task(stream())
        loop.run_until_complete(task)
    except KeyboardInterrupt:  # Ctrl-C: the line ends, as after the last token (the shell's prompt was left on it)
        if ends_line is not True:  # (unknown: a line more, at worst an empty one)
            sys.stdout.write("\n")
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                loop.run_until_complete(task)
        raise
    finally:
        scheduler.stop()
        loop.close()
    if not ends_line:  # the shell's prompt on a line of its own; a text that ends one is written as it is
        sys.stdout.write("\n")
    return 0


def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="convert a published model into a txlserve checkpoint")
    kinds = p.add_subparsers(dest="source", required=True)
    hf = kinds.add_parser("hf", help="a Hugging Face TransfoXL directory (config.json, model.safetensors, "
                                     "vocab.json or vocab.txt), e.g. transfo-xl/transfo-xl-wt103")
    hf.add_argument("src", help="the downloaded directory")
    hf.add_argument("--out", required=True, help="checkpoint directory to write: a new or empty one")
    hf.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="store the weights in this dtype (default: float32, whatever the published files hold)")
    hf.set_defaults(func=_cmd_import_hf)


def _cmd_import_hf(ns: argparse.Namespace) -> int:
    import torch

    from model.import_hf import import_hf
    from model.threads import set_threads

    set_threads(None)  # as every command that runs torch: deliberately, not torch's default (a helper)

    fingerprint = import_hf(ns.src, ns.out, dtype=getattr(torch, ns.dtype) if ns.dtype else None)
    print(json.dumps({"out": ns.out, "fingerprint": fingerprint}))
    return 0


_BENCH_HELP = "benchmarks that print one JSON object"


def _add_bench_placeholder(sub: argparse._SubParsersAction) -> None:
    """`bench` in the command list without importing the benchmarks (they import torch, ~2-3 s): every other
    command, and a usage error above all, answers without that wait. ``main`` builds the real one."""
    p = sub.add_parser("bench", help=_BENCH_HELP, add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda ns: main(["bench", *ns.args]))


_BENCHES = {  # `txlserve bench NAME`: the module bench.NAME (imported when the parser is built)
    "decode": "ring-buffer decoder vs the naive re-projecting decoder",
    "store": "memory-store latency, and restoring a session vs recomputing it",
    "serve": "concurrent streaming load, and continuing a session vs re-sending",
    "startup": "seconds from `txlserve serve` to /ready, against importing torch",
    "scale": "the published WikiText-103 shape (random weights): load, decode, sessions",
}


def _add_bench(sub: argparse._SubParsersAction) -> None:
    import importlib

    p = sub.add_parser("bench", help=_BENCH_HELP)
    kinds = p.add_subparsers(dest="bench", required=True)
    for name, summary in _BENCHES.items():
        module = importlib.import_module(f"bench.{name}")
        k = kinds.add_parser(name, help=summary)
        module.add_arguments(k)
        k.set_defaults(func=module.main)


# vLLM's names for the same settings, so that a vLLM command line carries over: the model to load, the name
# clients send, the keys, the most sequences decoded together
_VLLM_FLAGS = {"checkpoint": ("--model",), "model_name": ("--served-model-name",), "api_keys": ("--api-key",),
               "max_batch": ("--max-num-seqs",)}


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from server.settings import LISTS, Settings

    p = sub.add_parser("serve", help="serve the HTTP API (OpenAI-compatible completions, sessions, WebSocket)",
                       description="Every flag also reads TXLSERVE_<NAME> from the environment; flags win.")
    for f in Settings.__dataclass_fields__.values():
        flag = ["--" + f.name.replace("_", "-"), *_VLLM_FLAGS.get(f.name, ())]
        env = f"TXLSERVE_{f.name.upper()}"
        default = "" if f.default is None or f.name == "checkpoint" or f.name in LISTS else (
            f" (default: {f.default})")
        text = f"{f.metadata['help']}{default} [{env}]".replace("%", "%%")
        if f.name in LISTS:
            p.add_argument(*flag, nargs="+", default=None, metavar=f.name.split("_")[-1][:-1].upper(), help=text,
                           dest=f.name)
            continue
        if str(f.type) == "bool":  # --name / --no-name, so a flag can also undo the environment
            p.add_argument(*flag, action=argparse.BooleanOptionalAction, default=None, help=text, dest=f.name)
            continue
        typ = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        p.add_argument(*flag, type=typ, default=None, help=text, dest=f.name)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(ns: argparse.Namespace) -> int:
    import logging

    from memory_store.embedded import check_data_dir
    from memory_store.redis_tier import check_url
    from model.bundled import resolve_checkpoint
    from server import logs
    from server.listen import HOLDS_PORT, REUSE_PORT, bind, claim_port, start_listening
    from server.settings import LISTS, Settings, stray_variables

    overrides = {k: getattr(ns, k) for k in Settings.__dataclass_fields__ if getattr(ns, k, None) is not None}
    for name in LISTS:
        if name in overrides:
            overrides[name] = tuple(overrides[name])
    settings = Settings.from_env(**overrides)
    # a bad setting, a Redis URL that cannot be parsed, a port in use or a missing checkpoint is one line at once,
    # before torch is imported
    check_url(settings.redis_url)
    group = settings.server_processes > 1 and REUSE_PORT  # each worker listens on a socket of its own (server.workers)
    # held, not listening (where it can be claimed): a connection is refused until the server can answer it
    # (server.listen.start_listening), as vLLM's; one that listened at once hung through the load
    held = group or HOLDS_PORT
    sock = bind(settings.host, settings.port, group=group, listen=not held)
    claim = None
    # a data dir this start makes, removed if the start is refused before Redis wrote in it: one refused for its
    # device or its checkpoint's kind (found once the model loads) left an empty ./.txlserve behind (found by a
    # helper); the cheaper checks come first, so that most refusals never make it
    made = Path(settings.data_dir) if settings.redis_url is None and not Path(settings.data_dir).exists() else None
    try:
        claim = claim_port(sock.getsockname()[1]) if held else None
        if held and claim is None and not group:  # no claim to be had here: listen at once, as where none exists
            start_listening(sock)
        resolve_checkpoint(settings.checkpoint)
        if settings.redis_url is None:  # made last: a start refused for its checkpoint or address left an empty
            check_data_dir(settings.data_dir)  # ./.txlserve behind (found in the tests' own runs)
        logs.configure(settings.log_level, settings.log_format)
        for warning in stray_variables(settings):
            logging.getLogger("txlserve.serve").warning("%s", warning)
        if settings.server_processes > 1:  # this process supervises; each worker loads the model, or one engine
            from server.workers import serve_workers

            return serve_workers(settings, sock)
        if settings.engine_process:  # its imports run beside this process's next ones
            from server.core_spawn import spawn_early
            spawn_early()
        from server.serve import serve

        return serve(settings, sock)
    except BaseException:
        if made is not None:
            with contextlib.suppress(OSError):  # not empty: Redis wrote there, and what it wrote stays
                made.rmdir()
        raise
    finally:
        sock.close()
        if claim is not None:
            claim.close()


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", add_help=False, help="terminal client: txlserve-chat [--session ID] [--url URL]")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_chat)


def _cmd_chat(ns: argparse.Namespace) -> int:
    try:
        from txlserve_client.chat import main as chat_main
    except ImportError:
        print("txlserve: error: the terminal client needs the client package: pip install -e clients/python",
              file=sys.stderr)
        return 2
    return chat_main(ns.args, prog="txlserve chat") or 0


def _add_session(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("session", help="move sessions between servers: export one as a small JSON document "
                                       "(its last tokens), import it anywhere with the same tokenizer")
    acts = p.add_subparsers(dest="action", required=True)
    ex = acts.add_parser("export", help="write a session's export document (stdout, or --out)")
    ex.add_argument("session_id", help="the session to export (its id, as the sessions API gives it)")
    ex.add_argument("--out", help="file to write (default: stdout)")
    im = acts.add_parser("import", help="recreate a session from an export document; prints the new session")
    im.add_argument("file", help="the export document ('-': stdin)")
    for q in (ex, im):
        q.add_argument("--url", default=None, help="server URL (default: $TXLSERVE_BASE_URL or "
                                                   "http://127.0.0.1:8000)")
        q.add_argument("--api-key", default=None, help="Bearer key (default: $TXLSERVE_API_KEY)")
    p.set_defaults(func=_cmd_session)


def _cmd_session(ns: argparse.Namespace) -> int:
    from pathlib import Path

    try:
        from txlserve_client import APIError, Client
    except ImportError:
        print("txlserve: error: `txlserve session` needs the client package: pip install -e clients/python",
              file=sys.stderr)
        return 2
    try:
        with Client(base_url=ns.url, api_key=ns.api_key) as client:
            if ns.action == "export":
                text = json.dumps(client.sessions.export(ns.session_id))
                if ns.out:
                    Path(ns.out).write_text(text + "\n")
                else:
                    print(text)
                return 0
            try:
                raw = sys.stdin.buffer.read() if ns.file == "-" else Path(ns.file).read_bytes()
                if looks_pickled(raw[:4]):  # it was "not a JSON export document: 'utf-8' codec can't decode"
                    print(f"txlserve: error: {ns.file} is a pickle, which txlserve never loads: session import reads "
                          "the JSON document `txlserve session export` writes", file=sys.stderr)
                    return 2
                document = json.loads(raw.decode("utf-8-sig"))  # a BOM, as some editors write, is no reason to
            except (ValueError, RecursionError) as err:  # refuse one; JSON's errors, bytes not UTF-8, deep nesting
                why = "nested too deeply" if isinstance(err, RecursionError) else err
                print(f"txlserve: error: {ns.file} is not a JSON export document: {why}", file=sys.stderr)
                return 2
            made = client.sessions.import_(document)
            print(json.dumps({"id": made.id, "tokens_seen": made.tokens_seen, "tier": made.tier}))
            return 0
    except (APIError, ValueError) as err:  # ValueError: an argument the client refuses (an empty session id)
        print(f"txlserve: error: {err}", file=sys.stderr)
        return 2


class _DefaultsShown(argparse.HelpFormatter):
    """A flag's default at the end of its help, where the help does not give it: most of the benchmarks' flags
    said none (found by a helper)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help or "", action.default
        if (not action.option_strings or "default" in text or text == argparse.SUPPRESS or default is None
                or default is False or default == argparse.SUPPRESS or default in ((), [])):
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"  # 1,16,64 as it is typed


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line, like every other error of the command, pointing at --help. No flag is taken
    by a prefix of its name: ``serve --model PATH`` (vLLM's flag) had been taken as ``--model-name`` and served
    the bundled checkpoint under that name (found by a helper)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _DefaultsShown)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(*, with_bench: bool = True) -> argparse.ArgumentParser:
    parser = _Parser(prog="txlserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_eval(sub)
    _add_generate(sub)
    _add_serve(sub)
    _add_chat(sub)
    _add_session(sub)
    _add_import(sub)
    (_add_bench if with_bench else _add_bench_placeholder)(sub)
    return parser


_LEAVE_QUICKLY = {"train", "eval", "generate", "import"}  # compute, print, done: nothing runs at the process's exit


def main(argv: Sequence[str] | None = None) -> int:
    """The ``txlserve`` command (``argv``: given by a program that runs it inside its own process)."""
    own = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    code = _main(argv)
    if own and argv[:1] == ["serve"]:  # stopped, and leaving: a Ctrl-C pressed again in the interpreter's teardown
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # was a traceback (serve() puts its handler back for others)
    if own and argv[:1] and argv[0] in _LEAVE_QUICKLY:  # once torch has loaded a model, Python's teardown takes
        from server.leave import leave_without_finalizing  # ~0.4 s, and a torchrun worker's can abort (leave.py)
        leave_without_finalizing(code)
    return code


_STDOUT_CLOSED = "standard output is closed (redirect it: > FILE, or > /dev/null to discard what it says)"


def _main(argv: list[str]) -> int:
    # started with stdout closed (``>&-``): Python has none, so print() went nowhere (eval's figures lost, exit 0) and
    # generate's first write was an AttributeError's traceback. Said before the command works, as cat's write error
    # (at the first write, a train had run and saved, and a session import made its session); serve and session
    # export --out write nothing there
    if sys.stdout is None and not (argv[:1] == ["serve"] or (argv[:2] == ["session", "export"] and "--out" in argv)):
        print(f"txlserve: error: {_STDOUT_CLOSED}", file=sys.stderr)
        return 2
    if argv[:1] == ["chat"]:  # every flag after `chat` belongs to the client's own parser
        return _cmd_chat(argparse.Namespace(args=argv[1:]))
    try:  # the benchmarks' parsers import their modules (torch): a Ctrl-C meanwhile is an exit, not a traceback
        ns = build_parser(with_bench=argv[:1] == ["bench"]).parse_args(argv)
    except KeyboardInterrupt:
        return 130
    except RuntimeError as err:
        if _interrupted(err):
            return 130
        raise
    ns.argv = argv
    term = None
    if argv[:1] == ["bench"] and threading.current_thread() is threading.main_thread():
        # SIGTERM as Ctrl-C: the server a benchmark started (its engine, its Redis, its directory) is stopped by
        # the benchmark's own clean-up, which a plain SIGTERM skipped, leaving them running
        term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return ns.func(ns)
    except TxlError as err:
        print(f"txlserve: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file, socket or binary the command needed: still one line
        if isinstance(err, BrokenPipeError) and _reader_left():  # `txlserve generate ... | head`: as cat does
            return 141
        print(f"txlserve: error: {_os_error(err)}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as err:  # sizes that do not fit: torch's allocators raise RuntimeError
        text = str(err)
        if _interrupted(err):  # a Ctrl-C inside an import (torch's) comes wrapped in the RuntimeError it broke
            return 130
        if not isinstance(err, MemoryError) and not _OUT_OF_MEMORY.search(text):
            raise
        first = text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__
        print(f"txlserve: error: not enough memory for these settings (lower the sizes): {first}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if term is not None:  # put back: main() runs inside other programs too (the tests)
            signal.signal(signal.SIGTERM, term)


def _os_error(err: OSError) -> str:
    """``PATH: reason``, as cat and cp say it, not Python's ``[Errno 2] No such file or directory: 'PATH'``."""
    if err.filename is None or not err.strerror:
        return re.sub(r"^\[Errno \d+\] ", "", str(err))
    both = f"{err.filename} -> {err.filename2}" if err.filename2 is not None else str(err.filename)
    return f"{both}: {err.strerror}"


def _reader_left() -> bool:
    """Whether stdout is a pipe whose reader has closed it (``| head``). Then stdout becomes /dev/null, so that
    the interpreter's last flush fails no more, and the command ends quietly with SIGPIPE's status (Python's
    "Note on SIGPIPE"); a broken socket is still an error."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no stdout, or not a file
        return False
    if gone:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return gone


_OUT_OF_MEMORY = re.compile(r"can't allocate memory|out of memory|OutOfMemory", re.I)


def _interrupted(err: BaseException) -> bool:
    """Whether a KeyboardInterrupt lies behind ``err`` (Python wraps one raised in ``__set_name__`` as a class
    is made, which is where a Ctrl-C during ``import torch`` can land)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())

"""The server's one settings object: defaults, then ``TXLSERVE_*`` environment variables, then CLI flags."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from model.config import CLAMP_LEN_MOST, MEM_LEN_MOST
from txlserve.args import MAX_THREADS
from txlserve.errors import ConfigError

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_CHOICES = {  # settings that take one of a few words
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "storage_dtype": ("float32", "bfloat16", "float16"),
    "prefill_products": ("auto", "kernel", "torch"),
    "loop": ("auto", "asyncio", "uvloop"),
    "http": ("auto", "h11", "httptools"),
    "log_format": ("text", "json"),
}


def _opt(default: Any, help: str, **kw: Any) -> Any:
    """A setting with its ``--help`` text, so the CLI, the README and the code say one thing."""
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class Settings:
    checkpoint: str | None = _opt(None, "checkpoint directory (default: the bundled checkpoints/shakespeare-small)")
    host: str = _opt("127.0.0.1", "bind address; keep loopback unless API keys are set")
    port: int = _opt(8000, "TCP port")
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = _opt("auto", "weights and memory dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, "
                              "bfloat16, float16")
    threads: int | None = _opt(None, "torch CPU threads of each worker (default: half the usable cores divided "
                                     "among the workers, at least 1 each: more threads collapse when other "
                                     "processes share the cores)")
    workers: int = _opt(1, "server processes sharing the port and the store, each with its own engine, event loop "
                           "and hot sessions (as uvicorn's --workers): for a host where one process's event loop "
                           "runs out before its engine, as on a GPU; a session moves between them through Redis. "
                           "--hot-cache-mb and --batch-mb are per worker; /metrics labels each worker's samples")
    api_server_count: int = _opt(1, "API server processes sharing the port and one engine process (as vLLM's "
                                    "--api-server-count): one batch and one hot set, with HTTP, streaming and each "
                                    "request's lease and commit spread over N event loops; for a GPU whose engine "
                                    "outruns one process's event loop. Needs --engine-process; not with --workers")
    engine_process: bool = _opt(True, "run the engine (its scheduler, model and hot sessions) in a process of its "
                                      "own, as vLLM runs its engine core, so that the event loop and the engine do "
                                      "not share one interpreter (each worker gets its own); --no-engine-process "
                                      "runs it in the server's process, on a thread")
    engine_timeout_s: float = _opt(60.0, "with --engine-process: an engine that answers no ping for this long while "
                                         "requests run is taken for hung; it is killed, its requests fail (503) "
                                         "and /health turns 503, for a liveness probe to restart the server; with "
                                         "--api-server-count, an API server that reads nothing from the engine this "
                                         "long is dropped by it, so that the others go on (0: never)")
    mem_len: int | None = _opt(None, "attention window at inference (default: the checkpoint's)")
    clamp_len: int | None = _opt(None, "largest relative distance (default: the checkpoint's)")
    redis_url: str | None = _opt(None, "redis://, rediss:// or unix:// URL, or redis+cluster://host:port "
                                       "(any node of a Redis Cluster) (default: an embedded redis-server)")
    data_dir: str = _opt("./.txlserve", "where the embedded Redis keeps its append-only file")
    hot_cache_mb: int = _opt(1024, "byte budget of hot sessions, kept on the device in the engine's own form (a hot "
                                   "hit costs no copy and no restore), in MiB")
    session_ttl_s: int = _opt(7 * 86400, "idle TTL of a stored session in seconds (0 keeps sessions forever; a "
                                         "session in use is not idle)")
    cold_after_s: float = _opt(86400.0, "a session idle this many seconds keeps only its token window in Redis (the "
                                        "cold tier) and is rebuilt from it on its next use by a server that does "
                                        "not hold it hot; 0 never")
    warm_budget_mb: int = _opt(0, "most hidden-state bytes kept in Redis, in MiB: beyond it the least recently "
                                  "updated sessions go cold; 0 no limit")
    cold_sweep_s: float = _opt(60.0, "how often the cold-tier policy runs, in seconds")
    storage_dtype: str = _opt("float32", "dtype of memories written to Redis: float32, bfloat16 or float16")
    legacy_store_format: bool = _opt(False, "write sessions as servers before store format 3 read them (the memory "
                                            "inside the record, every commit whole): while such servers share the "
                                            "Redis during a rolling upgrade")
    api_keys: tuple[str, ...] = _opt((), "Bearer keys (comma-separated in the environment); each session "
                                         "belongs to the key that made it", )
    cors_origins: tuple[str, ...] = _opt((), "origins allowed to call the API from a browser (CORS), e.g. "
                                             "https://app.example.com, or * for any; none by default")
    allowed_hosts: tuple[str, ...] = _opt((), "host names the server answers to (the Host header, and a proxy's "
                                              "X-Forwarded-Host; *.example.com for its subdomains) besides IP "
                                              "addresses, localhost and this machine's name (and, beyond loopback, "
                                              "names of one label and under .local, .internal and .home.arpa): a "
                                              "server without API keys refuses other names (a web page can point a "
                                              "name it owns at the server's address: DNS rebinding); given, every "
                                              "server does, and takes no other name; * for any name")
    model_name: str | None = _opt(None, "the model name clients send (default: txl- and the checkpoint directory's "
                                        "name, as txl-shakespeare-small for the bundled one)")
    max_batch: int = _opt(256, "sessions advanced together per decode step, at most (fewer if --batch-mb is reached)")
    batch_mb: int = _opt(1024, "memory for the sessions generating together (their key/value rings), in MiB: "
                               "every waiting request joins the decode batch while it fits (on a GPU it is taken "
                               "whole at start-up: CUDA graphs read fixed addresses)")
    max_queue: int = _opt(256, "requests waiting beyond the batch before 429 (each server process's, with --workers "
                               "or --api-server-count); at most as many as --batch-mb holds sessions, since each "
                               "waits with its state in memory")
    max_tokens_limit: int = _opt(4096, "the largest max_tokens a request may ask for")
    max_prompt_bytes: int = _opt(1_000_000, "largest prompt, in tokens (bytes for a byte model); a request's "
                                 "prompts together, as sent (before truncate_prompt_tokens), an echoed one once "
                                 "for each choice")
    max_append_bytes: int = _opt(8_000_000, "largest appended document, in tokens (bytes for a byte model)")
    max_body_bytes: int = _opt(10_000_000, "largest request body, in bytes (413 beyond), and WebSocket message "
                                           "(closed with 1009 beyond)")
    body_timeout_s: float = _opt(30.0, "a request whose headers take this long, or whose body stops "
                                   "arriving for this long, gets 408")
    max_logprobs_values: int = _opt(1_000_000, "most log-probabilities one response carries, tokens x (1 + "
                                               "logprobs): a prompt scored with echo or prompt_logprobs (in each "
                                               "choice), or an append scored with logprobs, past it is refused (400) "
                                               "before it is read: 20 alternatives "
                                               "for each token of a 400 KB prompt had made a 200 MB response and "
                                               "held 2 GB")
    send_timeout_s: float = _opt(60.0, "a connection whose client reads nothing of its response (or WebSocket) for "
                                       "this long, while the server has more to send, is closed (nginx's "
                                       "send_timeout): its request stops as if the client had left; 0 never")
    max_stop: int = _opt(16, "most stop strings per request (OpenAI's limit is 4; vLLM has none, and "
                             "lm-evaluation-harness sends a task's list as it is)")
    max_stop_bytes: int = _opt(64, "longest stop string, in bytes")
    enforce_eager: bool = _opt(False, "run decode steps op by op in eager PyTorch instead of as one traced graph "
                                      "with the fused C attention on a CPU (the graph runs a step without "
                                      "taking the GIL, so the event loop no longer slows it) or as CUDA graphs "
                                      "on a GPU (one per batch size 1, 2, 4, 8, 16, 24, ..., captured at "
                                      "start-up); for debugging and comparison")
    disable_overlap_schedule: bool = _opt(False, "on a GPU, draw each decode step's tokens on the host once the step "
                                                 "is done, instead of on the device while the next step is queued "
                                                 "(as SGLang's --disable-overlap-schedule); for debugging and "
                                                 "comparison")
    stream_interval: int = _opt(1, "a request's generated tokens after its first are handed to the server's "
                                   "event loop, and so sent, in groups of this many, a chunk each (as vLLM's "
                                   "--stream-interval): "
                                   "fewer wake-ups, more tokens/s, burstier streams; 1 sends every token as it "
                                   "is made")
    cpu_latency_qos_us: int | None = _opt(None, "while requests run (and a second after), ask Linux to wake idle CPUs "
                                                "within this many microseconds (a PM QoS request on "
                                                "/dev/cpu_dma_latency; 0: idle CPUs poll instead of halting), so "
                                                "handing a token to the event loop does not wait for a halted CPU; "
                                                "machine-wide, costs idle power, needs write access to that file, "
                                                "root's by default (default: off)")
    switch_interval_ms: float = _opt(0.5, "the server process's GIL switch interval (Python's "
                                          "sys.setswitchinterval, 5 ms by default): the longest the event loop "
                                          "keeps the interpreter while the engine thread, back from a decode "
                                          "step, waits for it")
    prefill_chunk: int | None = _opt(None, "tokens read per prefill slice; decode steps run between slices "
                                           "(default: chosen from mem_len and the device)")
    prefill_products: str = _opt("auto", "a prefill slice's matrix products on a CPU: auto (both timed at load, "
                                         "torch's kept where at least 5% faster; a decode step's products are "
                                         "timed and chosen the same way), kernel (the C tiles: the same bits at "
                                         "any thread count) or torch (decode steps keep the C tiles with either)")
    lease_ttl_ms: int = _opt(30_000, "a session lease's TTL in ms (renewed while its request runs)")
    store_timeout_s: float = _opt(2.0, "Redis operation timeout in seconds")
    shutdown_timeout_s: float = _opt(30.0, "on SIGTERM, time in seconds for in-flight requests before they are "
                                           "cancelled")
    log_level: str = _opt("info", "debug, info, warning, error or critical")
    log_format: str = _opt("text", "text (a line each: time, level, logger, message; a request's message is a JSON "
                                   "object) or json (one JSON object a line from every logger, uvicorn's too, a "
                                   "request's fields at its top level: for a log collector)")
    loop: str = _opt("auto", "event loop, as uvicorn's --loop: auto (uvloop where installed, else asyncio's), "
                             "asyncio or uvloop")
    http: str = _opt("auto", "HTTP/1.1 parser, as uvicorn's --http: auto (httptools where installed, else h11), "
                             "h11 or httptools")

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, not "
                                  f"{getattr(self, name)!r}", param=name)
        for name in ("max_batch", "batch_mb", "max_queue", "max_tokens_limit", "prefill_chunk", "max_prompt_bytes",
                     "max_append_bytes", "max_body_bytes", "max_stop_bytes", "lease_ttl_ms", "mem_len",
                     "max_logprobs_values",
                     "stream_interval", "workers", "api_server_count"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}", param=name)
        if self.api_server_count > 1 and (self.workers > 1 or not self.engine_process):
            raise ConfigError("api_server_count > 1 shares one engine process among the API servers: it needs "
                              "--engine-process, and cannot be combined with --workers (each worker has an engine "
                              "of its own)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, not {self.port}", param="port")
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise ConfigError(f"threads must be from 1 to {MAX_THREADS}, not {self.threads}", param="threads")
        for name in ("cold_after_s", "warm_budget_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, not {getattr(self, name)}", param=name)
        if not self.cold_sweep_s > 0:
            raise ConfigError(f"cold_sweep_s must be > 0, not {self.cold_sweep_s}", param="cold_sweep_s")
        if not self.body_timeout_s > 0:
            raise ConfigError(f"body_timeout_s must be > 0, not {self.body_timeout_s}", param="body_timeout_s")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}", param="device")
        object.__setattr__(self, "log_level", self.log_level.lower())  # INFO, as containers often set it
        if self.log_level not in _LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(_LOG_LEVELS)}, not {self.log_level!r}",
                              param="log_level")
        if self.model_name is None:
            object.__setattr__(self, "model_name", default_model_name(self.checkpoint))
        if not self.model_name.strip() or self.model_name != self.model_name.strip() or len(self.model_name) > 256:
            raise ConfigError(f"model_name must be 1 to 256 characters with no surrounding white space, not "
                              f"{self.model_name!r}", param="model_name")
        for name in ("hot_cache_mb", "session_ttl_s", "max_stop", "clamp_len", "shutdown_timeout_s", "send_timeout_s",
                     "cpu_latency_qos_us", "engine_timeout_s"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, not {getattr(self, name)}", param=name)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, not {value}", param=f.name)
        if self.cpu_latency_qos_us is not None and self.cpu_latency_qos_us > 2_000_000_000:  # the kernel's "none"
            raise ConfigError(f"cpu_latency_qos_us must be at most 2000000000, not {self.cpu_latency_qos_us}",
                              param="cpu_latency_qos_us")
        # past these Redis's millisecond times (int64) or torch's int64 positions overflow: every session call was
        # a 503 "value is not an integer" from Redis, a clamp_len a traceback (found by a helper)
        for name, most, unit in (("mem_len", MEM_LEN_MOST, ""), ("clamp_len", CLAMP_LEN_MOST, ""),
                                 ("session_ttl_s", 100 * 365 * 86400, " (100 years; 0 keeps sessions forever)"),
                                 ("lease_ttl_ms", 86_400_000, " (a day)")):
            if getattr(self, name) is not None and getattr(self, name) > most:
                raise ConfigError(f"{name} must be at most {most}{unit}, not {getattr(self, name)}", param=name)
        if not 0 < self.switch_interval_ms <= 1000:
            raise ConfigError(f"switch_interval_ms must be in (0, 1000], not {self.switch_interval_ms}",
                              param="switch_interval_ms")
        if not self.store_timeout_s > 0:
            raise ConfigError(f"store_timeout_s must be > 0, not {self.store_timeout_s}", param="store_timeout_s")
        if any(not isinstance(k, str) or not k.strip() or k != k.strip() for k in self.api_keys):
            raise ConfigError("an API key may not be empty or start or end with white space")
        if any(not (k.isascii() and k.isprintable()) for k in self.api_keys):  # HTTP headers carry ASCII
            raise ConfigError("an API key must be printable ASCII: a client could never send it in a header")
        if any(" " in k or "," in k for k in self.api_keys):  # one key made of a list given in the other form: it
            raise ConfigError("an API key may not hold a space or a comma: keys are separated by commas in "  # locked
                              "TXLSERVE_API_KEYS and by spaces after --api-keys (--api-keys k1 k2)")  # all out
        for o in self.cors_origins:  # an origin as a browser sends it: no path, so a trailing / never matched
            if isinstance(o, str) and o != "*" and "*" in o:  # it would never match: origins are compared whole
                raise ConfigError(f"CORS origin {o!r}: an origin is matched whole, with no wildcards; list each one "
                                  "(https://a.example.com https://b.example.com), or give * for any",
                                  param="cors_origins")
            # any scheme: a browser extension's (chrome-extension://id), a desktop app's webview (tauri://localhost)
            if not isinstance(o, str) or not (o == "*" or re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s]+", o)):
                raise ConfigError(f"CORS origin {o!r} is not * or an origin as browsers send it, scheme://host[:port] "
                                  "with no path (https://app.example.com, not https://app.example.com/)",
                                  param="cors_origins")
            if o != "*" and o != (sent := _as_sent(o)):  # compared whole: one written otherwise never matched
                raise ConfigError(f"CORS origin {o!r} must be written as browsers send it, {sent!r}: origins are "
                                  "compared whole", param="cors_origins")

        for h in self.allowed_hosts:  # a name as a Host header carries it, less its port
            if not isinstance(h, str) or not re.fullmatch(r"\*|(\*\.)?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?", h):
                raise ConfigError(f"allowed host {h!r} is not * or a host name with no scheme, port or path "
                                  "(app.example.com, or *.example.com for its subdomains; an internationalised "
                                  "name in its xn-- form, as Host carries it)", param="allowed_hosts")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """``TXLSERVE_<NAME>`` for every field; explicit ``overrides`` (CLI flags, not None) win. An empty variable
        is an unset one (the default), as a compose file passes a variable it was not given: an empty
        TXLSERVE_ENGINE_PROCESS turned the engine process off, and an empty TXLSERVE_PORT was refused (found by a
        helper)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"TXLSERVE_{f.name.upper()}")
            if raw is not None and raw.strip() and overrides.get(f.name) is None:  # a flag's value wins
                values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except TypeError as err:
            raise ConfigError(str(err)) from None
        except ConfigError as err:  # named as the user gave it: the flag, or the variable (not the field)
            name = err.param
            if name not in values:
                raise
            given = f"--{name.replace('_', '-')}" if name in overrides else f"TXLSERVE_{name.upper()}"
            raise ConfigError(err.message.replace(name, given, 1), param=name) from None

    @property
    def server_processes(self) -> int:
        """Processes serving HTTP on the port: workers, or API servers of one shared engine process."""
        return max(self.workers, self.api_server_count)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


# TXLSERVE_ variables that are not the server's settings but are read elsewhere: the client's, the data
# loaders' cache, the compose file's published port, and the tests'
_NOT_SETTINGS = {"TXLSERVE_API_KEY", "TXLSERVE_BASE_URL", "TXLSERVE_DATA_CACHE", "TXLSERVE_PUBLISH",
                 "TXLSERVE_FUZZ_SECONDS", "TXLSERVE_FULL_EVAL", "TXLSERVE_UPDATE_SCREENSHOT"}


def _as_sent(origin: str) -> str:
    """An origin as browsers send it: scheme and host in lower case, without its scheme's default port."""
    scheme, _, host = origin.partition("://")
    scheme, host = scheme.lower(), host.lower()
    return f"{scheme}://{host.removesuffix({'http': ':80', 'https': ':443'}.get(scheme, ':'))}".rstrip(":")


# the settings that hold a list: comma-separated in the environment, several words after their flag
LISTS = tuple(f.name for f in fields(Settings) if str(f.type).startswith("tuple"))


def stray_variables(settings: Settings, env: Mapping[str, str] | None = None) -> list[str]:
    """Warnings for ``TXLSERVE_*`` variables the server does not read: a misspelt setting was dropped without a
    word, and ``TXLSERVE_API_KEY`` (the client's, one letter from ``TXLSERVE_API_KEYS``) left a server that was
    meant to require a key open to everyone (found by a helper)."""
    env = os.environ if env is None else env
    known = {f"TXLSERVE_{f.name.upper()}" for f in fields(Settings)}
    out = []
    if env.get("TXLSERVE_API_KEY", "").strip() and not settings.api_keys:
        out.append("TXLSERVE_API_KEY is set, but it is the client's variable: the server reads TXLSERVE_API_KEYS "
                   "(comma-separated) or --api-keys, and this one requires no API key")
    for name in sorted(n for n in env if n.startswith("TXLSERVE_") and n not in known | _NOT_SETTINGS):
        out.append(f"{name} is not a setting of txlserve serve (see its --help): ignored")
    return out


def default_model_name(checkpoint: str | None) -> str:
    """What a server answers to when it is not told: the checkpoint directory's name (vLLM's default is the model's
    path), under a prefix that keeps the bundled checkpoint's name, and so its clients, as they were when every
    checkpoint was served as txl-shakespeare-small."""
    name = "shakespeare-small" if checkpoint is None else os.path.basename(os.path.abspath(checkpoint))
    name = name.strip()[:252] or "model"  # a name the check below accepts, whatever the directory is called
    return name if name.startswith("txl-") else f"txl-{name}"


def env_names() -> list[str]:
    return [f"TXLSERVE_{f.name.upper()}" for f in fields(Settings)]


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = str(f.type)
    try:
        if f.name in LISTS:  # an empty item is refused, never silently dropped
            return tuple(k.strip() for k in raw.split(","))
        if kind.startswith("bool"):
            flag = raw.strip().lower()
            if flag not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(raw)
            return flag in ("1", "true", "yes", "on")
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        what = next(w for k, w in (("bool", "true or false (1/0, yes/no, on/off)"), ("int", "a whole number"),
                                   ("float", "a number"), ("", kind)) if kind.startswith(k))
        raise ConfigError(f"TXLSERVE_{f.name.upper()}={raw!r} is not {what} (or empty, for the default)") from None
    return raw

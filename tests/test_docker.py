"""The deployment files, read as data: docker cannot run in the test environment, so these check
what would break a build or a deployment without one."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from server.settings import env_names

yaml = pytest.importorskip("yaml")

DOCKER = Path(__file__).resolve().parents[1] / "docker"
REPO = DOCKER.parent


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or (line.startswith("#") and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def env_vars(ins: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in ins:
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(args))
    return env


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKER / "Dockerfile")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_base_and_build_args(dockerfile: list[tuple[str, str]]) -> None:
    args = dict(a.split("=", 1) for k, a in dockerfile if k == "ARG")
    assert args["BASE"].startswith("nvidia/cuda:") and "runtime" in args["BASE"]
    assert "cu12" in args["TORCH_INDEX"]
    assert [a for k, a in dockerfile if k == "FROM"] == ["${BASE}"]


def test_installs_torch_from_its_index_before_the_project(dockerfile: list[tuple[str, str]]) -> None:
    runs = [a for k, a in dockerfile if k == "RUN"]
    torch = next(i for i, r in enumerate(runs) if "pip install" in r and "TORCH_INDEX" in r)
    project = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch < project
    copies = [a.split()[0] for k, a in dockerfile if k == "COPY"]
    assert {"pyproject.toml", "model/", "memory_store/", "server/", "checkpoints/"} <= set(copies)
    order = [k + " " + a for k, a in dockerfile]
    assert order.index("RUN " + runs[project]) > max(order.index("COPY " + a) for k, a in dockerfile
                                                      if k == "COPY" and not a.startswith("checkpoints"))


def test_the_image_copies_every_package_the_project_installs(dockerfile: list[tuple[str, str]]) -> None:
    """txlserve/ (the error tree, the flags' types) was neither copied nor let through the context: the image's
    server failed to import at every start (found by a helper)."""
    include = re.search(r"include = \[(.*?)\]", (REPO / "pyproject.toml").read_text()).group(1)
    roots = {p.strip().strip('"').rstrip("*") for p in include.split(",")}
    packages = {p.name for p in REPO.iterdir() if p.name in roots and (p / "__init__.py").is_file()}
    copies = {a.split()[0].rstrip("/") for k, a in dockerfile if k == "COPY"}
    assert "txlserve" in packages and packages <= copies, packages - copies


def test_runs_as_a_non_root_user(dockerfile: list[tuple[str, str]]) -> None:
    users = [a for k, a in dockerfile if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    # and that user owns the data dir the embedded store would write to
    data_dir = env_vars(dockerfile)["TXLSERVE_DATA_DIR"]
    assert any(f"chown {users[-1]} {data_dir}" in a for k, a in dockerfile if k == "RUN")


def test_port_healthcheck_and_command(dockerfile: list[tuple[str, str]]) -> None:
    assert ("EXPOSE", "8000") in dockerfile
    health = [a for k, a in dockerfile if k == "HEALTHCHECK"]
    assert len(health) == 1 and "/ready" in health[0] and " CMD " in f" {health[0]} "
    assert [a for k, a in dockerfile if k == "CMD"] == ['["txlserve", "serve", "--host", "0.0.0.0"]']


def test_environment_names_are_settings(dockerfile: list[tuple[str, str]], compose: dict) -> None:
    names = set(env_names())
    used = {k for k in env_vars(dockerfile) if k.startswith("TXLSERVE_")}
    for service in compose["services"].values():
        used |= {k for k in service.get("environment", {}) if k.startswith("TXLSERVE_")}
    assert used and used <= names, used - names
    assert env_vars(dockerfile)["TXLSERVE_CHECKPOINT"].startswith("/app/checkpoints/")


def test_dockerignore_sends_what_the_dockerfile_copies(dockerfile: list[tuple[str, str]]) -> None:
    rules = [r for r in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
             if r.strip() and not r.startswith("#")]
    assert rules[0] == "*"  # an allowlist: .git, .venv, runs/ and the like never reach the daemon
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    copied = {a.split()[0].rstrip("/") for k, a in dockerfile if k == "COPY"}
    assert copied - {"./"} <= allowed
    assert {"README.md", "pyproject.toml"} <= allowed  # pip install . reads both
    for path in allowed - {"checkpoints"}:  # checkpoints/ is not in the repository yet
        assert (REPO / path).exists(), path


def test_compose_services(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"redis", "txlserve", "txlserve-cpu", "txlserve-a", "txlserve-b", "nginx"}
    redis = services["redis"]
    assert redis["command"][:3] == ["redis-server", "--appendonly", "yes"]
    assert "profiles" not in redis  # Redis runs with either profile
    volume = redis["volumes"][0].split(":")[0]
    assert volume in compose["volumes"]  # a named volume, not a bind mount

    for name in ("txlserve", "txlserve-cpu"):
        txl = services[name]
        assert txl["build"]["context"] == ".." and txl["build"]["dockerfile"] == "docker/Dockerfile"
        assert (DOCKER / txl["build"]["context"] / txl["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
        assert txl["environment"]["TXLSERVE_REDIS_URL"] == "redis://redis:6379/0"
        assert "redis" in txl["depends_on"]
        assert "/ready" in " ".join(txl["healthcheck"]["test"])
        assert "TXLSERVE_PORT" in " ".join(txl["healthcheck"]["test"])  # the port the server was given (was 8000)
    gpu, cpu = services["txlserve"], services["txlserve-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]  # plain `up` builds no image by accident
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "deploy" not in cpu and "cuda" not in cpu["build"]["args"]["BASE"]
    assert cpu["build"]["args"]["TORCH_INDEX"].endswith("/cpu") and cpu["image"] != gpu["image"]


def test_replicas_profile_puts_two_servers_behind_the_tested_nginx_config(compose: dict) -> None:
    services = compose["services"]
    a, b, lb = services["txlserve-a"], services["txlserve-b"], services["nginx"]
    assert a["profiles"] == b["profiles"] == lb["profiles"] == ["replicas"]
    assert a["image"] == b["image"] == services["txlserve-cpu"]["image"] and a["ports"] == b["ports"] == []
    assert a["environment"]["TXLSERVE_REDIS_URL"] == b["environment"]["TXLSERVE_REDIS_URL"]  # one Redis
    assert lb["volumes"] == ["./nginx.conf:/etc/nginx/nginx.conf:ro"]
    conf = (DOCKER / "nginx.conf").read_text()
    # what tests/test_lb.py runs; the names looked up again as they change, which takes nginx 1.27.3 or later
    assert "server txlserve-a:8000 resolve;" in conf and "server txlserve-b:8000 resolve;" in conf
    major, minor = (int(n) for n in lb["image"].split(":")[1].split("-")[0].split(".")[:2])
    assert (major, minor) >= (1, 28) and "resolver 127.0.0.11" in conf
    assert _published(lb["ports"][0]) == "127.0.0.1"


def _published(port_spec: str) -> str:
    """The host address of a compose port mapping, with ``${VAR:-default}`` taken at its default."""
    resolved = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", port_spec)
    return resolved.rsplit(":", 2)[0]


def test_compose_publishes_on_loopback_unless_told(compose: dict) -> None:
    for name in ("txlserve", "txlserve-cpu"):
        (spec,) = compose["services"][name]["ports"]
        assert _published(spec) == "127.0.0.1" and spec.endswith(":8000:8000")
        assert "TXLSERVE_PUBLISH" in spec


def test_second_replica_example_parses_when_uncommented(compose: dict) -> None:
    lines = (DOCKER / "compose.yaml").read_text().splitlines()
    start = lines.index("  # txlserve-2:")
    block = []
    for line in lines[start:]:
        if not line.startswith("  #"):
            break
        block.append(line.replace("# ", "", 1))
    doc = yaml.safe_load("\n".join(["x-txlserve: &txlserve", "  restart: unless-stopped", "services:", *block]))
    replica = doc["services"]["txlserve-2"]
    assert _published(replica["ports"][0]) == "127.0.0.1" and replica["ports"][0].endswith(":8001:8000")
    assert replica["restart"] == "unless-stopped"  # merged from the shared settings: the same Redis, shared sessions
    assert replica["image"] == compose["services"]["txlserve"]["image"]


def test_the_image_refuses_a_rebound_name_though_it_binds_every_interface(dockerfile: list[tuple[str, str]],
                                                                         compose: dict) -> None:
    """Published on the host's 127.0.0.1, a request reaches the container on its own address, not loopback (a check
    of loopback sockets alone had never applied there, found by a helper): without keys, as the image and compose
    run by default, a name a page pointed at 127.0.0.1 (DNS rebinding) is refused; localhost, addresses, nginx's
    $host and a compose service's name are served. With keys, any name."""
    from server.browsers import BrowserChecks
    from server.settings import Settings

    services = compose["services"]
    for name in ("txlserve", "txlserve-cpu", "txlserve-a", "txlserve-b"):  # a compose user can name theirs
        assert {"TXLSERVE_ALLOWED_HOSTS", "TXLSERVE_CORS_ORIGINS"} <= set(services[name]["environment"]), name
    envs = [env_vars(dockerfile)] + [{k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v))
                                      for k, v in services[name]["environment"].items()}
                                     for name in ("txlserve", "txlserve-cpu", "txlserve-a", "txlserve-b")]
    for env in envs:
        settings = Settings.from_env({**env, "TXLSERVE_REDIS_URL": ""})
        for keys in ((), ("key1",)):
            check = BrowserChecks(lambda *a: None, settings.allowed_hosts, settings.cors_origins, keyed=bool(
                settings.api_keys or keys))
            for host, refused in ((b"rebind.example:8000", not keys), (b"localhost:8000", False),
                                  (b"127.0.0.1:8000", False), (b"172.18.0.3:8000", False), (b"txlserve-a:8000", False)):
                scope = {"type": "http", "server": ("172.18.0.3", 8000), "headers": [(b"host", host)]}
                assert (check.host_refusal(scope) is not None) is refused, (env, keys, host)

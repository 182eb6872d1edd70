"""What a web page must not make the server do (server/browsers.py): DNS rebinding (a request to a server without
API keys must be addressed to an address, a name no page can point anywhere, or a name of --allowed-hosts) and
cross-site requests (a POST or DELETE, or a WebSocket, from a page of another origin). The browser's side of both is
in tests/test_playground.py."""

from __future__ import annotations

import asyncio
import base64
import json
import socket

import httpx
import pytest

from server.browsers import BrowserChecks, host_name, loopback_name, name_allowed
from server.settings import Settings
from tests.live import LiveServer, wait_for
from txlserve.errors import ConfigError

REBOUND = "rebind.example"


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:8000", "localhost"), ("LocalHost", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
    ("127.0.0.1:8000", "127.0.0.1"), ("evil.example.:80", "evil.example"), ("", ""), (" a.b ", "a.b"),
    ("[::1", "[::1"), ("a:b:c", "a:b:c"), ("[::1]rebind.example", "[::1]rebind.example"),
])
def test_host_name_is_the_header_less_its_port_and_final_dot(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST.", True), ("app.localhost", True), ("0.0.0.0", False), ("::", False), ("192.168.1.5", False),
    ("localhost.example", False), ("example.com", False), ("[::1]evil", False)])
def test_a_bind_address_is_loopback_only_where_it_reaches_this_host_alone(host, loopback):
    """What serve's keyless warning asks: it compared three strings, so a bind of 127.0.0.2, [::1] or
    app.localhost was warned of as open to anyone."""
    assert loopback_name(host) is loopback


def test_addresses_and_names_no_page_can_point_are_always_allowed_other_names_only_when_listed():
    for name in ("localhost", "app.localhost", "127.0.0.1", "127.8.9.1", "::1", "10.1.2.3", "203.0.113.9", "",
                 "::ffff:127.0.0.1", "txlserve", "gpu-box", "gpu-box.local", "txl.default.svc.cluster.local",
                 "api.internal"):
        assert name_allowed(name, ())
    for name in ("rebind.example", "localhost.example", "127.0.0.1.nip.io", "local.example", "internal.example.com",
                 "a.localhostx", "evil.com"):
        assert not name_allowed(name, ())
    assert name_allowed("xlocal", ())  # one label: no public DNS name
    for name in ("txlserve", "gpu-box.local", "api.internal", "nas.home.arpa"):  # the LAN can answer for these:
        assert not name_allowed(name, (), strict=True)  # not on loopback (mDNS, LLMNR)
    for name in ("localhost", "app.localhost", "127.0.0.1", "::1", socket.gethostname().lower()):
        assert name_allowed(name, (), strict=True)
    allowed = ("app.example", "*.corp.example")
    assert name_allowed("app.example", allowed) and name_allowed("a.corp.example", allowed)
    assert name_allowed("a.b.corp.example", allowed)
    assert not name_allowed("corp.example", allowed)  # a pattern names subdomains, as Starlette's
    assert not name_allowed("xcorp.example", allowed) and not name_allowed("app.example.evil", allowed)


def _through(allowed: tuple[str, ...], scope: dict, *, keyed: bool = False) -> list[dict]:
    """What BrowserChecks sends for a request in front of an app that answers 204."""
    sent: list[dict] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    checks = BrowserChecks(app, allowed, (), keyed=keyed)
    asyncio.run(checks({"type": "http", "method": "GET", "headers": [], **scope}, receive, send))
    return sent


LAN = ("172.18.0.3", 8000)  # the address a request reached: a container's, not loopback


@pytest.mark.parametrize(("allowed", "keyed", "headers", "status", "server"), [
    ((), False, [(b"host", b"rebind.example:8000")], 403, LAN),
    ((), False, [(b"host", b"localhost:8000")], 204, LAN),
    ((), False, [(b"host", b"txlserve:8000")], 204, LAN),  # a compose service's name
    ((), False, [(b"host", b"txlserve:8000")], 403, ("127.0.0.1", 8000)),  # on loopback: a name the LAN answers for
    ((), False, [(b"host", b"localhost:8000")], 204, ("::1", 8000)),
    ((), False, [(b"host", b"127.0.0.1:8000"), (b"x-forwarded-host", b"rebind.example:8080")], 403, LAN),  # a proxy's
    ((), False, [(b"host", b"127.0.0.1:8000"), (b"x-forwarded-host", b"localhost:8080")], 204, LAN),
    ((), False, [(b"host", b"127.0.0.1:8000"), (b"x-forwarded-host", b"localhost:8080, rebind.example")], 403, LAN),
    ((), False, [(b"host", b"localhost"), (b"host", b"rebind.example")], 403, LAN),  # every Host, not the first
    ((), True, [(b"host", b"rebind.example:8000")], 204, LAN),  # keys: a page has none; a tunnel's Host stays served
    (("app.example",), True, [(b"host", b"rebind.example")], 403, LAN),  # a list given is checked, keys or not
    (("app.example",), True, [(b"host", b"APP.example.")], 204, LAN),
    (("app.example",), False, [(b"host", b"10.0.0.5:8000")], 204, LAN),
    (("app.example",), False, [(b"host", b"txlserve:8000")], 403, LAN),  # a list says which names: only those
    (("*",), False, [(b"host", b"rebind.example")], 204, LAN),
])
def test_the_host_check_answers_or_passes_on(allowed, keyed, headers, status, server):
    sent = _through(allowed, {"headers": headers, "server": server}, keyed=keyed)
    assert sent[0]["status"] == status
    if status == 403:
        body = json.loads(sent[1]["body"])["error"]
        assert body["type"] == "permission_error" and body["code"] == "host_not_allowed"
        assert ("rebind.example" in body["message"] or "txlserve" in body["message"]) and "--allowed-hosts" in body[
            "message"]


SERVER = ("127.0.0.1", 8000)
OWN = [(b"host", b"127.0.0.1:8000")]


@pytest.mark.parametrize(("kind", "headers", "cors", "refused"), [
    ("POST", [], (), False),  # no Origin, no Sec-Fetch-Site: not a browser (curl, an SDK)
    ("POST", [(b"origin", b"https://evil.example")], (), True),  # an older browser's cross-site form
    ("POST", [(b"origin", b"null")], (), True),  # a sandboxed frame, a data: or file: page
    ("POST", [(b"origin", b"http://[::1")], (), True),
    ("POST", [(b"origin", b"http://127.0.0.1:8000")], (), False),  # the server's own page (its Host)
    ("POST", [(b"origin", b"http://127.0.0.1:9000")], (), True),  # another port is another origin
    ("POST", [(b"origin", b"https://public.example:8443"), (b"x-forwarded-host", b"public.example:8443")], (),
     False),  # its page behind a proxy
    ("POST", [(b"sec-fetch-site", b"cross-site"), (b"origin", b"https://evil.example")], (), True),
    ("POST", [(b"sec-fetch-site", b"cross-site")], (), True),  # the browser's word, even with no Origin
    ("POST", [(b"sec-fetch-site", b"same-site"), (b"origin", b"http://localhost:3000")], (), True),  # a dev server
    ("POST", [(b"sec-fetch-site", b"same-origin"), (b"origin", b"https://public.example")], (), False),  # a proxy
    ("POST", [(b"sec-fetch-site", b"none")], (), False),  # typed by the user
    ("POST", [(b"sec-fetch-site", b"cross-site"), (b"origin", b"https://app.example.com")],
     ("https://app.example.com",), False),  # one of --cors-origins
    ("POST", [(b"sec-fetch-site", b"cross-site"), (b"origin", b"https://evil.example")], ("https://app.example.com",),
     True),
    ("POST", [(b"sec-fetch-site", b"cross-site"), (b"origin", b"https://evil.example")], ("*",), False),
    ("websocket", [(b"origin", b"chrome-extension://abcdefgh")], ("chrome-extension://abcdefgh",), False),  # its own
    ("websocket", [(b"origin", b"chrome-extension://other")], ("chrome-extension://abcdefgh",), True),
    ("DELETE", [(b"sec-fetch-site", b"cross-site"), (b"origin", b"https://evil.example")], (), True),
    ("PATCH", [(b"origin", b"https://evil.example")], (), True),
    ("GET", [(b"sec-fetch-site", b"cross-site"), (b"origin", b"https://evil.example")], (), False),  # CORS's part
    ("HEAD", [(b"origin", b"https://evil.example")], (), False),
    ("OPTIONS", [(b"origin", b"https://evil.example")], (), False),  # a preflight: CORS answers it
    ("websocket", [(b"origin", b"https://evil.example")], (), True),  # a handshake is a GET, checked all the same
    ("websocket", [(b"origin", b"http://127.0.0.1:8000")], (), False),
    ("websocket", [], (), False),
])
def test_the_origin_check_refuses_what_a_page_of_another_origin_sends(kind, headers, cors, refused):
    scope = {"type": "websocket" if kind == "websocket" else "http", "server": SERVER, "headers": OWN + headers}
    if kind != "websocket":
        scope["method"] = kind
    err = BrowserChecks(lambda *a: None, (), cors, keyed=False).origin_refusal(scope)
    assert (err is not None) is refused
    if err is not None:
        assert (err.status, err.code) == (403, "origin_not_allowed") and "--cors-origins" in err.message
        compared = not any(k == b"sec-fetch-site" for k, _ in headers) and dict(headers).get(
            b"origin", b"").startswith(b"http")
        assert ("X-Forwarded-Host" in err.message) is compared  # what a proxy in front must pass on, where it helps


@pytest.mark.parametrize(("origin", "refused"), [
    (b"http://127.0.0.1:8080", False),  # the page nginx served
    (b"http://127.0.0.1", True),  # another port of that host: nginx's Host ($host) had lost its port, and matched
    (b"https://127.0.0.1", True),
    (b"http://127.0.0.1:8000", True),  # the replica's own port is not the page's, behind the proxy
])
def test_behind_a_proxy_the_origin_is_compared_with_its_forwarded_host_alone(origin, refused):
    """docker/nginx.conf passes Host without its port and X-Forwarded-Host with it (found by a helper)."""
    for kind, forwarded in (("websocket", b"127.0.0.1:8080"), ("http", b"127.0.0.1:8080"),
                            ("http", b"127.0.0.1:8080, txlserve-inner:8000")):  # a second proxy appended its own
        headers = [(b"host", b"127.0.0.1"), (b"x-forwarded-host", forwarded), (b"origin", origin)]
        scope = {"type": kind, "server": SERVER, "headers": headers, "method": "POST"}
        err = BrowserChecks(lambda *a: None, (), (), keyed=False).origin_refusal(scope)
        assert (err is not None) is refused, (kind, origin)


@pytest.mark.parametrize("bad", ["http://app.example", "app.example:8000", "app.example/", "", " app.example",
                                 "a..b", "*example.com", "**.example.com"])
def test_an_allowed_host_that_no_host_header_could_match_is_refused_at_start(bad):
    with pytest.raises(ConfigError, match="allowed host"):
        Settings(allowed_hosts=(bad,))
    assert Settings.from_env({"TXLSERVE_ALLOWED_HOSTS": "app.example, *.corp.example"}).allowed_hosts == (
        "app.example", "*.corp.example")


def _handshake(port: int, host: str, origin: str | None = None) -> bytes:
    """A WebSocket handshake by hand (a client library sets Host itself): the server's answer, head and body."""
    key = base64.b64encode(bytes(16)).decode()
    origin_line = f"Origin: {origin}\r\n" if origin else ""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"GET /v1/ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                     f"{origin_line}\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer or (answer.startswith(b"HTTP/1.1 403") and not answer.endswith(b"}}")):
            got = sock.recv(4096)
            if not got:
                break
            answer += got
        return answer


def _logged(srv: LiveServer, request_id: str) -> dict:
    def line() -> dict | None:
        for text in srv.log.read_text().splitlines():
            if "txlserve.requests: " in text and request_id in text:
                return json.loads(text.split("txlserve.requests: ", 1)[1])
        return None
    return wait_for(line, 30, f"the log line of {request_id}")


def test_a_keyless_server_refuses_a_rebound_name_over_http_and_websocket(server, keyed_server):
    """As a page of rebind.example sends once that name points at 127.0.0.1: same-origin to its browser (no CORS;
    its WebSocket's Origin is its Host), so only the Host tells it apart. Refused: no session listed, made or
    streamed. Served: localhost, *.localhost, this machine's name and addresses, as browsers and clients send them;
    and on a server with keys, any name (a page has no key to send)."""
    port = int(server.url.rsplit(":", 1)[1])
    rebound = f"{REBOUND}:{port}"
    for method, path in (("GET", "/v1/sessions"), ("POST", "/v1/sessions"), ("GET", "/"), ("GET", "/health"),
                         ("POST", "/v1/completions"), ("GET", "/nowhere")):
        r = httpx.request(method, server.url + path, headers={"host": rebound, "origin": f"http://{rebound}",
                                                              "x-request-id": f"rebound-{method}-{len(path)}"},
                          json={"model": "m", "prompt": "x"} if method == "POST" else None, timeout=30)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["error"]["code"] == "host_not_allowed" and rebound in r.json()["error"]["message"]
    logged = _logged(server, "rebound-POST-12")
    assert logged["status"] == 403 and logged["error"] == "host_not_allowed" and logged["refused"] == rebound

    answer = _handshake(port, rebound, origin=f"http://{rebound}")
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "host_not_allowed"
    assert _handshake(port, f"localhost:{port}").startswith(b"HTTP/1.1 101")

    for host in (f"localhost:{port}", f"app.localhost:{port}", f"127.0.0.1:{port}", "127.0.0.1", f"[::1]:{port}",
                 f"{socket.gethostname()}:{port}"):
        r = httpx.get(server.url + "/v1/sessions", headers={"host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)
    for host in (f"txlserve:{port}", f"box.local:{port}"):  # on loopback: names a machine on the LAN can answer for
        assert httpx.get(server.url + "/v1/sessions", headers={"host": host}, timeout=30).status_code == 403
    keyed = httpx.get(keyed_server.url + "/v1/models", timeout=30,
                      headers={"host": rebound, "authorization": f"Bearer {keyed_server.keys[0]}"})
    assert keyed.status_code == 200, keyed.text


def test_allowed_hosts_are_served_and_others_refused_keys_or_not(checkpoint, redis_url, tmp_path):
    """A proxy that passes on its own Host (nginx's ``proxy_set_header Host $host``) needs its names listed; a
    list given is checked on a server with keys too. The environment's form, as a compose file sets it."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path / "d",
                     env={"TXLSERVE_ALLOWED_HOSTS": "app.example,*.corp.example", "TXLSERVE_API_KEYS": "k1"}).start()
    try:
        for host, status in (("app.example", 200), ("app.example:443", 200), ("a.corp.example", 200),
                             ("corp.example", 403), (REBOUND, 403), ("localhost", 200)):
            r = httpx.get(srv.url + "/v1/models", headers={"host": host, "authorization": "Bearer k1"}, timeout=30)
            assert r.status_code == status, (host, r.text)
    finally:
        srv.stop()


def test_a_page_of_another_origin_cannot_make_fork_or_delete_a_session(server):
    """A cross-site form or no-cors fetch needs no preflight and no readable answer to act: an empty POST made
    a session, a DELETE (which preflights, but a server with --cors-origins * allows it) ended one. Refused by their
    Origin or Sec-Fetch-Site; the same calls without them (not a browser) and from the server's own page served."""
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Once upon"}, timeout=30).json()["id"]
    foreign = [{"origin": "https://evil.example"}, {"origin": "null"},
               {"sec-fetch-site": "cross-site", "origin": "https://evil.example"},
               {"sec-fetch-site": "same-site", "origin": "http://localhost:3000"}]
    for headers in foreign:
        for method, path in (("POST", "/v1/sessions"), ("POST", f"/v1/sessions/{sid}/fork"),
                             ("POST", f"/v1/sessions/{sid}/append"), ("DELETE", f"/v1/sessions/{sid}"),
                             ("POST", "/v1/completions")):
            r = httpx.request(method, server.url + path, headers={"content-type": "text/plain", **headers},
                              content=b"", timeout=30)
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", (headers, path, r.text)
    session = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=30).json()
    assert session["tokens_seen"] == len("Once upon")  # untouched
    own = {"origin": server.url, "sec-fetch-site": "same-origin"}
    fork = httpx.post(f"{server.url}/v1/sessions/{sid}/fork", headers=own, timeout=30)
    assert fork.status_code == 201, fork.text
    for target in (fork.json()["id"], sid):
        assert httpx.delete(f"{server.url}/v1/sessions/{target}", headers={"origin": server.url},
                            timeout=30).status_code == 200

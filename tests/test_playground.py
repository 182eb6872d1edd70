"""The web playground in a real headless Chromium (the system's, driven by selenium) against a live server: it
loads without console errors, creates a session, streams a continuation equal to the HTTP API's at temperature 0,
cancel stops a stream, and a fork appears in the list. It writes a screenshot (docs/playground.png is one)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.live import LONG, MODEL, REPO

pytestmark = pytest.mark.timeout(180)
WAIT_S = 60
DOC = "HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"


def _browser_paths() -> tuple[str, str] | None:
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                    None)
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    paths = _browser_paths()
    if paths is None:
        pytest.skip("no Chromium and chromedriver on PATH (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=paths[1]))
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(condition, message=f"waiting for {what}")


def _settled(driver) -> None:
    """Wait until no refresh of the session list is in flight (the page counts them in ``data-pending``)."""
    _wait(driver, lambda d: d.execute_script("return document.body.dataset.pending") in (None, "0"),
          "the session list to settle")


def _click(driver, selector: str) -> None:
    """Click once the list is settled; a list re-rendered under the click is found again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    _settled(driver)
    WebDriverWait(driver, WAIT_S, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: d.find_element("css selector", selector).click() or True, message=f"clicking {selector}")


def _by_id(driver, element_id: str):
    return driver.find_element("id", element_id)


def _count(driver, element_id: str) -> int | None:
    """A number the page shows with the browser's grouping (``1,280`` in en-US, ``1.280`` or ``1 280`` elsewhere)."""
    digits = re.sub(r"\D", "", _by_id(driver, element_id).text)
    return int(digits) if digits else None


def _type(driver, element_id: str, text: str) -> None:
    box = _by_id(driver, element_id)
    box.clear()
    box.send_keys(text)


def _create_and_continue(driver, what: str) -> None:
    """A session of DOC from the page's form, then 8 tokens of " And" streamed at temperature 0 over its WebSocket."""
    _type(driver, "new-text", DOC)
    _by_id(driver, "create").click()
    _wait(driver, lambda d: _count(d, "m-tokens") == len(DOC), f"a session made {what}")
    _type(driver, "prompt", " And")
    _type(driver, "max-tokens", "8")
    _type(driver, "temperature", "0")
    _by_id(driver, "continue").click()
    _wait(driver, lambda d: "finish_reason: length, 8 tokens" in _by_id(d, "finish").text, f"the stream's end {what}")


def _sessions(driver) -> list[str]:
    """The listed session ids, read in one script call (the list is re-rendered as it refreshes)."""
    return driver.execute_script("return [...document.querySelectorAll('#sessions li')].map(li => li.dataset.id)")


def test_the_playground_creates_streams_cancels_and_forks(server, browser, tmp_path):
    driver = browser
    with httpx.Client(base_url=server.url, timeout=30) as c:  # more sessions than one page of the list holds
        for _ in range(105):
            assert c.post("/v1/sessions", json={}).status_code == 201
    driver.get(server.url + "/")
    _wait(driver, lambda d: MODEL in _by_id(d, "model-line").text, "the model line")
    assert driver.title == "txlserve playground"

    # every control is named for assistive technology (a <label> or aria-label)
    unnamed = driver.execute_script(
        "return [...document.querySelectorAll('input, textarea, button')].filter(e => !(e.labels && e.labels.length)"
        " && !e.getAttribute('aria-label') && !e.textContent.trim()).map(e => e.id)")
    assert unnamed == []

    # create a session from a document, from the keyboard (Enter in the title submits); it is selected and listed
    from selenium.webdriver.common.keys import Keys

    _type(driver, "new-text", DOC)
    _type(driver, "new-title", "hamlet")
    _by_id(driver, "new-title").send_keys(Keys.ENTER)
    _wait(driver, lambda d: _by_id(d, "current").text not in ("", "no session selected"), "the new session")
    sid = _by_id(driver, "current").text
    _wait(driver, lambda d: _count(d, "m-tokens") == len(DOC), "its memory panel")
    assert sid in _sessions(driver)
    twin = httpx.post(f"{server.url}/v1/sessions/{sid}/fork", timeout=30).json()["id"]  # the same memory, by HTTP

    # stream a continuation at temperature 0 over the WebSocket: it equals the HTTP API's from the same memory
    _type(driver, "prompt", "Or to take arms")
    _type(driver, "max-tokens", "40")
    _type(driver, "temperature", "0")
    _by_id(driver, "continue").click()
    _wait(driver, lambda d: "finish_reason" in _by_id(d, "finish").text, "the end of the stream")
    assert "finish_reason: length, 40 tokens" in _by_id(driver, "finish").text
    assert _by_id(driver, "prompt").get_attribute("value") == ""  # in the session now: a second click resent it
    streamed = _by_id(driver, "generated").get_attribute("textContent")
    http = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Or to take arms", "max_tokens": 40, "temperature": 0, "session_id": twin})
    assert streamed == http.json()["choices"][0]["text"]
    _wait(driver, lambda d: _count(d, "m-tokens") == len(DOC) + len("Or to take arms") + 40,
          "the memory panel after the continuation")

    # cancel stops a long stream within a step, and what was generated is committed
    _type(driver, "prompt", "")
    _type(driver, "max-tokens", str(LONG))  # more than an engine of its own makes before the click lands
    _type(driver, "temperature", "0.8")
    _by_id(driver, "continue").click()
    _wait(driver, lambda d: len(_by_id(d, "generated").get_attribute("textContent")) >= 5, "some streamed text")
    # the keyboard's focus moved to Cancel (Continue, disabled under it, dropped it to the page), and Escape cancels
    assert driver.switch_to.active_element.get_attribute("id") == "cancel"
    driver.switch_to.active_element.send_keys(Keys.ESCAPE)
    _wait(driver, lambda d: "finish_reason: cancelled" in _by_id(d, "finish").text, "the cancelled stream")
    got = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=30).json()["tokens_seen"]
    assert len(DOC) + len("Or to take arms") + 40 < got < len(DOC) + len("Or to take arms") + 40 + LONG

    # a fork appears in the list and becomes the selected session
    _settled(driver)
    before = set(_sessions(driver))
    _click(driver, f'#sessions li[data-id="{sid}"] button.fork')
    _wait(driver, lambda d: len(set(_sessions(d)) - before) == 1, "the fork in the list")
    (forked,) = set(_sessions(driver)) - before
    _wait(driver, lambda d: _by_id(d, "current").text == forked, "the fork selected")
    assert _count(driver, "m-tokens") == got
    titled = httpx.get(f"{server.url}/v1/sessions/{forked}", timeout=30).json()["metadata"]
    assert titled == {"title": "hamlet (fork)"}  # two cards of one title were told apart by id alone
    # from the keyboard: the list redrawn under a focused button keeps the focus on that button (it fell to the
    # page, and Tab began again at the top)
    _settled(driver)
    before = set(_sessions(driver))
    driver.execute_script("document.querySelector(arguments[0]).focus()", f'#sessions li[data-id="{forked}"] .fork')
    driver.switch_to.active_element.send_keys(Keys.ENTER)
    _wait(driver, lambda d: len(set(_sessions(d)) - before) == 1, "the keyboard's fork in the list")
    (again,) = set(_sessions(driver)) - before
    _wait(driver, lambda d: _by_id(d, "current").text == again, "the keyboard's fork selected")
    _settled(driver)
    assert driver.execute_script("const e = document.activeElement; return e.closest('li') && "
                                 "[e.closest('li').dataset.id, e.className]") == [forked, "fork secondary"]
    assert httpx.delete(f"{server.url}/v1/sessions/{again}", timeout=30).status_code == 200
    _by_id(driver, "refresh").click()
    _settled(driver)
    _click(driver, f'#sessions li[data-id="{forked}"] button.select')
    _wait(driver, lambda d: _by_id(d, "current").text == forked, "the fork selected again")

    # a blank control is its default (it was read as 0: greedy, or "max_tokens 0 generates nothing"); letters are
    # refused by name; the error is in view however far the page is scrolled (it was below the panels)
    for control in ("max-tokens", "temperature", "top-p", "top-k"):
        _type(driver, control, "")
    _type(driver, "prompt", "")
    _by_id(driver, "prompt").send_keys(Keys.CONTROL, Keys.ENTER)  # the keyboard's way to stream
    _wait(driver, lambda d: "finish_reason" in _by_id(d, "finish").text, "a stream with the default settings")
    assert "finish_reason: length, 200 tokens" in _by_id(driver, "finish").text
    _by_id(driver, "max-tokens").send_keys("1e")  # what a number field takes of letters: not a number
    driver.execute_script("window.scrollTo(0, document.body.scrollHeight)")
    _by_id(driver, "continue").click()
    _wait(driver, lambda d: "max tokens: not a number" in _by_id(d, "error").text, "the refused control")
    assert driver.execute_script("const r = document.getElementById('error').getBoundingClientRect(); "
                                 "return r.top >= 0 && r.bottom <= window.innerHeight")
    _type(driver, "max-tokens", "16")

    # a session deleted elsewhere (another tab, a replica) is no longer shown as selected with its old figures
    _wait(driver, lambda d: _by_id(d, "current").text == forked, "the fork still selected")
    assert httpx.delete(f"{server.url}/v1/sessions/{forked}", timeout=30).status_code == 200
    long_title = httpx.post(f"{server.url}/v1/sessions", json={"metadata": {"title": "A" * 200}}, timeout=30)
    _by_id(driver, "refresh").click()
    _wait(driver, lambda d: _by_id(d, "current").text == "no session selected", "the deleted session deselected")
    assert _by_id(driver, "m-tokens").text == "—"
    # and a long unbroken title wraps in its card (it ran off it, and the list scrolled sideways)
    card = f'#sessions li[data-id="{long_title.json()["id"]}"]'
    assert driver.execute_script("const li = document.querySelector(arguments[0]); "
                                 "return li.scrollWidth <= li.clientWidth", card)

    # no console errors at any point
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors

    # phone width: nothing wider than the screen
    driver.set_window_size(390, 844)
    assert driver.execute_script("return document.documentElement.scrollWidth") <= 390
    driver.set_window_size(1280, 900)
    shot = tmp_path / "playground.png"
    driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("TXLSERVE_UPDATE_SCREENSHOT"):  # refresh the one in docs/
        shutil.copy(shot, REPO / "docs" / "playground.png")
    assert (REPO / "docs" / "playground.png").is_file()  # the README shows it
    Path(shot).unlink()


PREFIXED = """pid nginx.pid;
error_log stderr;
events { worker_connections 64; }
http {
  access_log off;
  client_body_temp_path body; proxy_temp_path proxy; fastcgi_temp_path fastcgi; uwsgi_temp_path uwsgi;
  scgi_temp_path scgi;
  map $http_upgrade $connection_upgrade { default upgrade; '' close; }
  server {
    listen 127.0.0.1:PORT;
    location /txl/ {
      proxy_pass http://127.0.0.1:UPSTREAM/;
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header X-Forwarded-Host $http_host;  # the WebSocket's origin check knows the page's host
      proxy_buffering off;
    }
  }
}
"""


def test_the_playground_works_under_a_path_prefix(server, browser, tmp_path):
    """Behind a proxy that serves the server at /txl/ (and nothing at /), the page's files, its HTTP calls and its
    WebSocket keep the prefix: its paths are relative to the page (they were absolute: /static, /v1)."""
    from tests.live import free_port, nginx

    port = free_port()
    url = f"http://127.0.0.1:{port}/txl/"
    with nginx(tmp_path, PREFIXED.replace("UPSTREAM", str(server.port)).replace("PORT", str(port)), url + "ready"):
        driver = browser
        driver.get_log("browser")  # drop what an earlier test left
        driver.get(url)
        _wait(driver, lambda d: MODEL in _by_id(d, "model-line").text, "the model line, read through the prefix")
        accent = "return getComputedStyle(document.documentElement).getPropertyValue('--accent').trim()"
        assert driver.execute_script(accent) == "#2458c6", "the stylesheet did not load through the prefix"
        _create_and_continue(driver, "through the prefix")  # its WebSocket too
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors


def test_the_playground_with_api_keys_connects_once_a_key_is_typed_and_shows_a_streams_error(checkpoint, redis_url,
                                                                                             browser, tmp_path):
    """With keys, the page's first call is refused (401) and said so; a key typed then re-read only the list, so
    the model stayed unknown and every continuation was refused for its null model. And a stream's error (here,
    nothing to continue from) was cleared at once by the list's refresh that followed it: only "failed" showed."""
    from selenium.webdriver.common.keys import Keys

    from tests.live import LiveServer

    key = "sk-playground-123"
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path / "keyed", args=("--api-keys", key)).start()
    try:
        driver = browser
        driver.get_log("browser")  # drop what an earlier test left
        driver.get(srv.url + "/")
        _wait(driver, lambda d: "enter an API key" in _by_id(d, "error").text, "the 401, said")
        assert _by_id(driver, "model-line").text == "not connected"
        _by_id(driver, "api-key").send_keys(key, Keys.TAB)  # a change event
        _wait(driver, lambda d: MODEL in _by_id(d, "model-line").text, "the model line, once the key is typed")
        _settled(driver)
        assert _by_id(driver, "error").text == ""
        _create_and_continue(driver, "with the key")

        _type(driver, "new-text", "")  # an empty session, continued with no prompt: the server refuses it
        _by_id(driver, "create").click()
        _wait(driver, lambda d: _count(d, "m-tokens") == 0, "the empty session")
        _type(driver, "prompt", "")
        _by_id(driver, "continue").click()
        _wait(driver, lambda d: _by_id(d, "finish").text == "failed", "the refused stream")
        _settled(driver)  # the list refreshed after the stream ended: the error is still shown
        assert "nothing to continue from" in _by_id(driver, "error").text
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"
                  and "401" not in e["message"]]  # the refused first call, logged by the browser
        assert not errors, errors

        # a key that changed without the field's change event (autofill; a key rotated on the server): the
        # WebSocket's refused handshake read "the server does not answer", the model line still connected
        driver.execute_script("document.getElementById('api-key').value = 'sk-not-the-key'")
        _type(driver, "prompt", " more")
        _by_id(driver, "continue").click()
        _wait(driver, lambda d: "401" in _by_id(d, "error").text, "the refused key, said")
        assert "enter an API key" in _by_id(driver, "error").text and "does not answer" not in _by_id(
            driver, "error").text
        assert _by_id(driver, "model-line").text == "not connected"
        assert _by_id(driver, "prompt").get_attribute("value") == " more"  # refused: not in the session, kept
        _by_id(driver, "api-key").clear()
        _by_id(driver, "api-key").send_keys(key, Keys.TAB)
        _wait(driver, lambda d: MODEL in _by_id(d, "model-line").text, "connected again with the key")

        # the server killed mid-stream: the page said only "connection closed (1006)", still "connected"
        _type(driver, "max-tokens", str(LONG))
        _by_id(driver, "continue").click()
        _wait(driver, lambda d: len(_by_id(d, "generated").get_attribute("textContent")) >= 5, "a long stream")
        srv.kill()
        _wait(driver, lambda d: "connection to the server was lost" in _by_id(d, "error").text, "the lost server")
        assert "does not answer" in _by_id(driver, "model-line").text
    finally:
        srv.stop()

// The txlserve playground: plain JavaScript over the public API (no build step, no CDN).
"use strict";
const $ = (id) => document.getElementById(id);
// running: a stream, or its start (connect() first), is under way; cancelled: its Cancel came before its socket
// opened; streamed: the session whose continuation #output holds
// forgotten: a key was refused, and what the last one showed is off the screen until a list comes back
const state = { model: null, selected: null, socket: null, running: false, cancelled: false, streamed: null,
                offline: false, forgotten: false };

function key() { return $("api-key").value.trim(); }

let errorFrom = null;  // what showed the error: the list's refresh (or connecting) clears only its own
function showError(message, from = null) { $("error").textContent = message || ""; errorFrom = message ? from : null; }

function notConnected() {  // the server did not answer: the header says so until a request gets through
  state.model = null; state.offline = true;
  $("model-line").textContent = "not connected: the server does not answer";
}

async function api(method, path, body) {
  if (/[^\x20-\x7e]/.test(key())) {  // fetch refuses such a header with a TypeError, which read as "the server did
    // not answer" while it was up (found by a helper)
    throw new Error("the API key holds characters a request header cannot carry (printable ASCII only): check " +
                    "what was typed or pasted");
  }
  const headers = { "content-type": "application/json" };
  if (key()) headers.authorization = "Bearer " + key();
  if (state.selected && path.startsWith("/v1/sessions/" + state.selected)) headers["x-session-id"] = state.selected;
  // relative to the page: behind a proxy that serves the server under a prefix (/txl/), requests keep it
  let response;
  try {
    response = await fetch(path.replace(/^\//, ""), { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) {  // no answer at all: the browser's own words ("Failed to fetch") say nothing of why
    notConnected();
    throw Object.assign(new Error("the server did not answer (is it running? the page retries with your next action)"),
                        { connection: true });
  }
  if (errorFrom === "connection") showError("");  // it answers again: the old "no answer" is stale
  if (state.offline) { state.offline = false; if (path !== "/v1/models") connect(); }  // and the header says so
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const err = (data && data.error) || {};
    // a proxy's own page (nginx's 502) has no code: "502: Bad Gateway", not "502 : Bad Gateway"
    throw new Error(`${response.status}${err.code ? " " + err.code : ""}: ${err.message || response.statusText}`);
  }
  return data;
}

function fmtBytes(n) {
  if (n >= 1e6) return (n / 1e6).toFixed(2) + " MB";
  if (n >= 1e3) return (n / 1e3).toFixed(1) + " KB";
  return n + " B";
}

const TIERS = { hot: "hot: on the device, ready", redis: "Redis: hidden states", cold: "cold: token window only" };
const tierName = (tier) => (TIERS[tier] || tier).split(":")[0];  // the list's word for it: the panel's first

function showMemory(s) {
  if (!s) {
    for (const id of ["m-tokens", "m-memlen", "m-bytes", "m-tier", "m-window"]) $(id).textContent = "—";
    $("current").textContent = "no session selected";
    $("bar-doc").style.width = $("bar-mem").style.width = "0";
    return;
  }
  $("current").textContent = s.id;
  $("m-tokens").textContent = s.tokens_seen.toLocaleString();
  $("m-memlen").textContent = s.mem_len.toLocaleString() + " tokens per layer";
  $("m-bytes").textContent = fmtBytes(s.bytes);
  $("m-tier").textContent = TIERS[s.tier] || s.tier;
  $("m-window").textContent = (s.window_tokens || 0).toLocaleString() + " tokens";
  // the document's bar grows with tokens seen (log scale); the memory's stops at mem_len
  const scale = (n) => Math.min(100, 12 * Math.log10(1 + n));
  $("bar-doc").style.width = scale(s.tokens_seen) + "%";
  $("bar-mem").style.width = scale(Math.min(s.tokens_seen, s.mem_len)) + "%";
}

function failed(e, from = null) {  // a refused key says what to do, whichever call met it (Create's said nothing)
  const refused = String(e.message).startsWith("401");
  showError(e.message + (refused ? " (enter an API key above)" : ""), e.connection ? "connection" : from);
  if (refused) forget();
}

function forget() {  // a key refused (changed, cleared): the last key's sessions, titles, figures and continuation
  // leave the screen, which had kept them beside the 401 (found by a helper). The selection is kept, unshown: the
  // list a key gets back selects it again if the key's, and deselects it if not
  if ($("sessions").contains(document.activeElement)) $("api-key").focus();  // it fell to the page with the list
  $("sessions").replaceChildren(); $("list-note").textContent = "";
  state.forgotten = true; renaming = null;
  showMemory(null); clearOutput();
}

async function refreshSelected() {
  if (!state.selected) return showMemory(null);
  const id = state.selected;
  let s;
  try { s = await api("GET", "/v1/sessions/" + id); }
  catch (e) {
    if (state.selected !== id) return;  // another session chosen meanwhile: this one's answer is not its
    if (String(e.message).startsWith("404")) {  // deleted elsewhere (another tab, a replica) or another key's:
      state.selected = null;  // its figures must not stay on screen as if it were there
      showMemory(null); dropOutput(id); clearOutput();
    }
    return failed(e);
  }
  if (state.selected === id) showMemory(s);  // a slow answer for the last one overwrote the next one's figures
}

function clearOutput() {  // the continuation shown is the selected session's, or none. Another session's is hidden,
  // not dropped, streaming or ended (selecting that one shows it): one that ended while another was selected was
  // dropped, though the note had said "select it to see it", and its text had gone into the session (a helper)
  const theirs = state.streamed !== state.selected || state.forgotten;
  $("output").hidden = $("finish").hidden = theirs;
  $("elsewhere").hidden = !(theirs && state.running && !state.forgotten);
}

function dropOutput(id) {  // a session gone (deleted, another key's): its continuation goes too
  if (id && state.streamed === id && !state.running) {
    $("output").replaceChildren(); $("finish").textContent = ""; state.streamed = null;
  }
}

function select(id) {
  if (state.selected !== id) {  // another session chosen: an action's error, an append's result, were the last's
    showError("");
    $("append-result").textContent = "";
  }
  state.selected = id;
  clearOutput();
  for (const li of document.querySelectorAll("#sessions li")) li.classList.toggle("selected", li.dataset.id === id);
  refreshSelected();
}

const BLOCK_CHARS = 2000;  // a streamed continuation's text is shown in blocks of about this many characters
let renaming = null;  // the rename under way: { id, field }
let pending = 0;  // list refreshes in flight: document.body.dataset.pending, so a script (or test) can wait
function busy(delta) { pending += delta; document.body.dataset.pending = String(pending); }

async function refreshList() {
  busy(+1);
  try {
    // the newest 1,000 sessions at most, newest first
    let all = [], cursor = null, more = false;
    for (let i = 0; i < 10; i++) {
      const page = await api("GET", "/v1/sessions?order=desc&limit=100" +
                             (cursor ? "&after=" + encodeURIComponent(cursor) : ""));
      all = all.concat(page.data);
      more = page.has_more;
      if (!more) break;
      cursor = page.next_cursor;
    }
    $("list-note").textContent = more ? `showing the newest ${all.length.toLocaleString()} sessions` : "";
    const list = $("sessions");
    // the keyboard's focus, on a button of the list about to be redrawn: put back on the same button, else on
    // the selected session's (a fork made, a session deleted); it fell to the page, and Tab began at the top
    const had = list.contains(document.activeElement) ? document.activeElement : null;
    const was = had && had.closest("li") ? [had.closest("li").dataset.id, had.className.split(" ")[0]] : null;
    // a rename under way is opened again on its redrawn card, with what was typed (a stream's end or another
    // action's refresh dropped a half-typed title); the old field's blur, as it goes, saves nothing
    const open = renaming && { id: renaming.id, value: renaming.field.value,
                               focused: renaming.field === document.activeElement,
                               range: [renaming.field.selectionStart, renaming.field.selectionEnd] };
    renaming = null;
    state.forgotten = false;
    list.replaceChildren();
    for (const s of all) {
      const li = document.createElement("li");
      li.dataset.id = s.id;
      const title = (s.metadata && s.metadata.title) || "untitled";
      li.innerHTML = `<strong></strong> <span class="muted small"></span><div class="sid"></div>`;
      li.querySelector("strong").textContent = title;
      li.querySelector("span").textContent = `${s.tokens_seen.toLocaleString()} tokens, ${tierName(s.tier)}`;
      li.querySelector(".sid").textContent = s.id;
      for (const [label, cls, act] of [["Select", "select", () => select(s.id)],
                                       ["Rename", "rename", () => rename(li, s)],
                                       ["Fork", "fork", () => fork(s.id, s.metadata)],
                                       ["Delete", "delete", () => remove(s.id)]]) {
        const b = document.createElement("button");
        b.type = "button"; b.textContent = label; b.className = cls + (cls === "select" ? "" : " secondary");
        b.setAttribute("aria-label", `${label} session ${title} ${s.id}`);
        b.dataset.act = `${cls} ${s.id}`;
        if (acting.has(b.dataset.act)) b.setAttribute("aria-busy", "true");
        b.addEventListener("click", cls === "fork" || cls === "delete" ? () => once(b.dataset.act, b, act) : act);
        li.appendChild(b);
      }
      list.appendChild(li);
    }
    // not in a whole list: gone (deleted elsewhere), or another key's, so no longer shown as selected with its last
    // figures beside 404s; past a cut list's end it may be older than the newest 1,000: select() asks the server,
    // and only its 404 deselects it (it was deselected, though it was there)
    if (state.selected && !more && !all.some((s) => s.id === state.selected)) {
      dropOutput(state.selected); state.selected = null;
      showMemory(null); clearOutput();
    }
    if (state.selected) select(state.selected);
    if (had) {
      const same = was && list.querySelector(`li[data-id="${CSS.escape(was[0])}"] button.${was[1]}`);
      const chosen = state.selected && list.querySelector(`li[data-id="${CSS.escape(state.selected)}"] button.select`);
      (same || chosen || $("refresh")).focus();
    }
    const card = open && list.querySelector(`li[data-id="${CSS.escape(open.id)}"]`);
    if (card) rename(card, all.find((s) => s.id === open.id), open);
    if (errorFrom === "list") showError("");  // a stream's or an action's error stays until the next action
  } catch (e) { failed(e, "list"); } finally { busy(-1); }
}

const acting = new Set();  // the actions whose request runs: "create", "fork s-1", "delete s-1"
async function once(what, button, act) {  // one request an action: a double click (or Enter pressed twice) made
  // two sessions, two forks, or a delete then its 404 (found by a helper). Marked busy, not disabled: a disabled
  // button drops the keyboard's focus to the page. By name, not by button: the list redrawn meanwhile (a stream's
  // end) made a new button of the same action
  if (acting.has(what)) return;
  acting.add(what); button.setAttribute("aria-busy", "true");
  try { await act(); } finally {
    acting.delete(what);
    button.removeAttribute("aria-busy");  // and the button a redrawn list made for it
    for (const b of document.querySelectorAll(`[data-act="${CSS.escape(what)}"]`)) b.removeAttribute("aria-busy");
  }
}

async function create(event) {
  event.preventDefault();
  await once("create", $("create"), async () => {
    const title = $("new-title").value.trim(), text = $("new-text").value;
    showError("");
    // a long document takes a while (2 MB: minutes on a CPU): the page says it is at work
    $("create-status").textContent = text ? `reading ${text.length.toLocaleString()} characters…` : "creating…";
    try {
      const made = await api("POST", "/v1/sessions", { text, metadata: title ? { title } : undefined });
      $("new-text").value = ""; $("new-title").value = "";
      state.selected = made.id; clearOutput();
      await refreshList();
    } catch (e) { failed(e); } finally { $("create-status").textContent = ""; }
  });
}

async function fork(id, metadata) {
  showError("");
  try {  // the parent's metadata, its title marked: two cards of one title were told apart by id alone
    const title = metadata && metadata.title;  // (a huge one is inherited as it is: never a fork's 413)
    const body = title && title.length < 1000 ? { metadata: { ...metadata, title: title + " (fork)" } } : {};
    const made = await api("POST", `/v1/sessions/${id}/fork`, body);
    state.selected = made.id; clearOutput();
    await refreshList();
  }
  catch (e) { failed(e); }
}

function rename(li, s, reopen = null) {
  // the title becomes a field in its place: Enter or leaving it keeps what it holds (empty: untitled), Escape the
  // old title; only the title key changes (POST /v1/sessions/{id} merges metadata), and the memory stays as it is
  const strong = li.querySelector("strong");
  if (!strong) return;  // its field is open: a second click on Rename, whose blur has just kept the title
  const old = (s.metadata && s.metadata.title) || "";
  const field = document.createElement("input");
  field.className = "rename";  // the list redrawn under it puts the focus back on this card's Rename
  field.value = reopen ? reopen.value : old;
  field.setAttribute("aria-label", `New title for session ${s.id}`);
  renaming = { id: s.id, field };
  const finish = async (save) => {
    if (!renaming || renaming.field !== field) return;  // closed already, or redrawn
    renaming = null;
    const title = field.value.trim();
    if (save && title !== old) {
      // an error shown stays until the answer: cleared as the field left (on the mousedown of another card's
      // Rename), it moved the list up under the pointer, and the click landed beside that button
      try { await api("POST", "/v1/sessions/" + s.id, { metadata: { title: title || null } }); showError(""); }
      catch (e) {
        // gone (deleted here, the Delete that took the focus from the field, or elsewhere): its card goes too, and
        // no error: the session's absence says it
        if (String(e.message).startsWith("404")) { showError(""); return refreshList(); }
        failed(e);  // refused (a 409 while a request runs on it, say): the field stays, with what was typed
        // (opened again on its card where the list was redrawn while the title was on its way), unless another
        // card's opened meanwhile: one rename at a time
        if (renaming !== null) return refreshList();
        const card = $("sessions").querySelector(`li[data-id="${CSS.escape(s.id)}"]`);
        if (field.isConnected) renaming = { id: s.id, field };
        else if (card) rename(card, s, { value: field.value, focused: card.contains(document.activeElement),
                                         range: [field.selectionStart, field.selectionEnd] });
        return;
      }
    }
    await refreshList();
  };
  field.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { e.preventDefault(); finish(true); }
    else if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); finish(false); }  // not a stream's cancel
  });
  field.addEventListener("blur", () => finish(true));
  strong.replaceWith(field);
  if (!reopen || reopen.focused) {
    field.focus();
    if (reopen) field.setSelectionRange(...reopen.range); else field.select();
  }
}

async function remove(id) {
  showError("");
  try {
    await api("DELETE", "/v1/sessions/" + id);
    dropOutput(id);
    if (state.selected === id) { state.selected = null; clearOutput(); }
    await refreshList(); refreshSelected();
  } catch (e) { failed(e); }
}

async function fileText(file) {  // its bytes as UTF-8, or an error: file.text() put U+FFFD for each byte that is not
  // (a Latin-1 é), and the session silently got text the file does not hold
  let bytes;
  try { bytes = await file.arrayBuffer(); }
  catch (e) { throw new Error(`could not read ${file.name} (moved or changed since it was chosen?): choose it again`); }
  try { return new TextDecoder("utf-8", { fatal: true }).decode(bytes); }
  catch (e) { throw new Error(`the file is not UTF-8 text (${file.name}): nothing was appended`); }
}

async function append() {
  if (!state.selected) return showError("select or create a session first");
  const id = state.selected, file = $("doc-file").files[0];
  showError("");
  // one at a time, from the file's read on: a second click was the page's own 409, left beside the success
  $("append").disabled = true;
  try {
    let text = $("doc-text").value;
    if (file) text += await fileText(file);  // in the try: a file that cannot be read was an unhandled rejection
    if (!text) return showError("nothing to append");
    const t0 = performance.now();
    $("append-result").textContent = `appending ${text.length.toLocaleString()} characters…`;
    const r = await api("POST", `/v1/sessions/${id}/append`, { text });
    const ms = performance.now() - t0;
    const quality = r.bpc != null ? `${r.bpc.toFixed(3)} bits per token` : "";
    $("doc-text").value = ""; $("doc-file").value = "";
    if (state.selected === id) {  // another session chosen meanwhile: its panel is not this one's to overwrite
      $("append-result").textContent = `${r.appended_tokens.toLocaleString()} tokens in ${ms.toFixed(0)} ms` +
        (quality ? `, ${quality}` : "");
      showMemory(r);
    }
    refreshList();
  } catch (e) {
    if (state.selected === id) $("append-result").textContent = "";
    failed(e);
  } finally { $("append").disabled = false; }
}

function wsUrl() {
  const url = new URL("v1/ws", location.href);  // relative to the page, as api() is
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.search = url.hash = "";
  return url.href;
}

function wsProtocols() {  // the key as a subprotocol, base64url: a page's WebSocket sends no header of its own, and
  // ?api_key= went into a proxy's error log with every failed upstream (found by a helper)
  if (!key()) return [];
  const b64 = btoa(String.fromCharCode(...new TextEncoder().encode(key())));
  return ["txlserve", "txlserve.api-key." + b64.replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "")];
}

function setRunning(running) {
  const focused = document.activeElement;  // a button disabled under the keyboard's focus dropped it to the page
  state.running = running;
  $("continue").disabled = running; $("cancel").disabled = !running;
  if (focused === $("continue") || focused === $("cancel") || focused === document.body) {
    $(running ? "cancel" : "continue").focus();
  }
}

function sampling() {  // the controls' numbers: a blank one is its default; letters are refused, not read as 0
  const out = {};
  for (const [id, name] of [["max-tokens", "max_tokens"], ["temperature", "temperature"], ["top-p", "top_p"],
                            ["top-k", "top_k"]]) {
    const input = $(id);
    if (input.validity.badInput) throw new Error(`${input.parentElement.firstChild.textContent.trim()}: not a number`);
    out[name] = Number(input.value.trim() === "" ? input.defaultValue : input.value);
  }
  return out;
}

async function startContinue() {
  if (state.running) return;  // a stream, or its start, under way (Enter in a control, a double click)
  if (!state.selected) return showError("select or create a session first");
  let params;
  try { params = sampling(); } catch (e) { return showError(e.message); }
  const id = state.selected;
  // running from here, before the wait on connect(): a double click while not connected passed the checks twice
  // and streamed twice into the session, the second stream's text never shown
  state.socket = null; state.cancelled = false; state.streamed = id;
  // the output is this session's from here: a start that stopped before streaming (no connection, a refused key,
  // a Cancel while connecting) had left the last session's continuation in it, shown then under this one
  $("output").replaceChildren(); $("finish").textContent = "";
  setRunning(true);
  if (!state.model && !(await connect())) return setRunning(false);  // not connected yet (no key when the page
  // loaded, a server restarted)
  if (state.cancelled) {  // cancelled while connecting: nothing was sent
    $("finish").textContent = "cancelled: nothing was stored";
    return setRunning(false);
  }
  showError("");
  const out = $("output");  // (emptied as the start began)
  const prompt = $("prompt").value;
  if (prompt) { const p = document.createElement("span"); p.className = "prompt"; p.textContent = prompt; out.appendChild(p); }
  const gen = document.createElement("span"); gen.className = "generated"; out.appendChild(gen);
  $("finish").textContent = "streaming…";
  const socket = new WebSocket(wsUrl(), wsProtocols());
  state.socket = socket;
  let opened = false, taken = false;
  const end = (finish) => {  // then the output follows the selection: another session's stays hidden no more
    $("finish").textContent = finish; setRunning(false); clearOutput();
  };
  socket.onopen = () => {
    opened = true;
    if (state.cancelled) {  // a Cancel while the socket opened (a send then threw, and the cancel was lost)
      socket.close();
      return end("cancelled: nothing was stored");
    }
    socket.send(JSON.stringify({ type: "completion.create", model: state.model, prompt, session_id: id, ...params }));
  };
  const took = () => {  // the prompt is in the session once the stream runs: cleared then (a second click sent
    if (!taken && $("prompt").value === prompt) $("prompt").value = "";  // it again); a refusal keeps it
    taken = true;
  };
  // a socket's handlers act only while it is the current one: the previous stream's socket may report its
  // close after this one started, and must not mark this one stopped (its cancel button disabled)
  const current = () => state.socket === socket;
  // the deltas of a frame are shown together, a text node (two where a block ends) and one scroll a frame: a
  // text node per delta (of a tiny model's 10,000 a second) made every frame lay out more nodes, the page fell
  // behind, and a Cancel clicked after 13,000 characters was acted on 12 s later, the stream then 117,000 tokens long
  let shown = "", framed = false, block = gen, blockChars = 0;
  const show = () => {
    framed = false;
    if (!shown) return;
    // in blocks of whole lines, so a frame lays out the last block alone (one block of 100,000 characters took the
    // frame 8 ms, and the page fell seconds behind its clicks): a block's last newline ends its last line. A line
    // twice as long ends its block where this frame's text ends (after its last space, if it has one), which
    // wraps the line there; a line of 180,000 characters kept the page 3.5 s behind
    const full = blockChars + shown.length;
    let cut = full >= BLOCK_CHARS ? shown.lastIndexOf("\n") : -1;
    if (cut < 0 && full >= 2 * BLOCK_CHARS) cut = shown.lastIndexOf(" ");
    if (cut < 0 && full >= 2 * BLOCK_CHARS) cut = shown.length - 1;
    if (cut >= 0) {
      block.append(shown.slice(0, cut + 1));
      block = document.createElement("div"); block.className = "generated"; out.appendChild(block);
      blockChars = 0; shown = shown.slice(cut + 1);
    }
    if (shown) { block.append(shown); blockChars += shown.length; shown = ""; }
    out.scrollTop = out.scrollHeight;
  };
  socket.onmessage = (event) => {
    if (!current()) return;
    const msg = JSON.parse(event.data);
    if (msg.type === "completion.delta") {
      took();
      shown += msg.text;
      if (!framed) { framed = true; requestAnimationFrame(show); }
      return;
    }
    show();  // what came before the stream's end
    let finish = $("finish").textContent;  // a message of another type ends it as before, its line unchanged
    if (msg.type === "completion.done") {
      took();
      finish = `finish_reason: ${msg.finish_reason}, ${msg.usage.completion_tokens} tokens`;
    } else if (msg.type === "error" && msg.error.code === "request_cancelled") {  // the user's own cancel, while
      finish = "cancelled: nothing was stored";  // the prompt was read: not a failure
    } else if (msg.type === "error") {  // a message without a status (not this server's) had a leading space
      showError(`${msg.status ? msg.status + " " : ""}${msg.error.code}: ${msg.error.message}`);
      finish = "failed";
    }
    end(finish); socket.close(); refreshSelected(); refreshList();
  };
  socket.onerror = () => {  // "streaming…" stayed on screen: the close that follows skipped a stopped stream
    if (current() && state.running && !opened) {  // the handshake failed (an open socket's end is onclose's)
      if (state.cancelled) return end("cancelled: nothing was stored");
      end("failed: no connection");
      whyRefused();
    }
  };
  socket.onclose = (event) => {  // why, where the close says: 1009 is a message over the server's body limit
    if (current() && state.running) {
      end(event.code === 1009 ? "closed: the prompt is over the server's message size limit"
        : `connection closed (${event.code}${event.reason ? ": " + event.reason : ""})`);
      if (event.code === 1006) {  // no close from the server: it went away mid-stream (killed, or the network)
        notConnected();
        showError("the connection to the server was lost mid-stream (is it running? the page retries with your " +
                  "next action)", "connection");
      }
    }
  };
}

async function whyRefused() {
  // a browser tells a page nothing of why a WebSocket's handshake failed (a refused key, a server gone): the
  // HTTP API, asked the same, says it; a refused key said "the server does not answer", the model line connected
  try {
    await api("GET", "/v1/models");
    showError("the WebSocket connection was refused while HTTP is answered: a proxy without the WebSocket upgrade, " +
              "or one that does not pass this page's host on (X-Forwarded-Host), or this page's origin not " +
              "allowed (--cors-origins); the server's log names it");
  } catch (e) {
    if (String(e.message).startsWith("401")) { state.model = null; $("model-line").textContent = "not connected"; }
    failed(e);
  }
}

function cancel() {  // before the socket opens a send threw ("Still in CONNECTING state"), the cancel was lost and
  // the stream ran to its end: the cancel is kept, and the request is never sent (onopen)
  if (!state.running) return;
  if (state.socket && state.socket.readyState === WebSocket.OPEN) state.socket.send(JSON.stringify({ type: "cancel" }));
  else state.cancelled = true;
}

async function start() {
  $("create-form").addEventListener("submit", create);
  $("refresh").addEventListener("click", refreshList);
  $("append").addEventListener("click", append);
  $("continue").addEventListener("click", startContinue);
  $("cancel").addEventListener("click", cancel);
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.running) cancel(); });
  // Ctrl+Enter (Cmd+Enter) in the prompt, Enter in a sampling control: stream (Enter alone is a prompt's newline)
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey) && !state.running) { e.preventDefault(); startContinue(); }
  });
  for (const id of ["max-tokens", "temperature", "top-p", "top-k"]) {
    $(id).addEventListener("keydown", (e) => { if (e.key === "Enter" && !state.running) startContinue(); });
  }
  $("api-key").addEventListener("change", connect);  // a key typed after a 401: the model, then the list
  await connect();
}

async function connect() {  // the served model (the WebSocket's requests name it), then the session list
  try {
    const models = await api("GET", "/v1/models");
    const m = models.data[0];
    state.model = m.id;
    $("model-line").textContent = `${m.id}: ${m.n_layer} layers, d_model ${m.d_model}, mem_len ${m.mem_len}`;
  } catch (e) {
    state.model = null;
    if (!e.connection) $("model-line").textContent = "not connected";
    failed(e, "list");
    return false;
  }
  await refreshList();
  return true;
}

start();

// rill playground: drives /generate over WebSocket (and /ws/chat for spoken questions and
// replies), renders replies as Markdown, keeps the conversation across reloads, plots /metrics.
//
// Rules kept throughout: server messages and user text only ever reach the page through
// textContent or title (never parsed as HTML); a reply's Markdown becomes DOM nodes only through
// the sanitizer (renderMarkdown); every request goes to this page's own origin. The API key
// lives in sessionStorage and travels as a WebSocket subprotocol ("rill.key.<base64url>") or an
// Authorization header, never in a URL. The conversation (text only) lives in localStorage.
//
// Tests read the page's state from data attributes on #app: data-state, data-tokens,
// data-generation, data-modify-marks, data-finish-reason, data-feedback-id, data-error,
// data-model, data-mic (idle, starting, recording, encoding), data-mic-seconds, data-transcript.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const app = $("app");
  const PARAMS = ["temperature", "top_p", "top_k", "max_tokens", "repetition_penalty", "seed"];
  const INT_PARAMS = new Set(["top_k", "max_tokens", "seed"]);
  const RUNNING = new Set(["starting", "loading", "waiting", "generating", "paused"]);
  const CONTROLLABLE = new Set(["waiting", "generating", "paused"]);
  const KEY_STORAGE = "rill.apiKey";
  const CONVERSATION_STORAGE = "rill.conversation";
  const MARKDOWN_THROTTLE_MS = 100; // a streaming reply is re-rendered at most this often
  const MIC_RATE_HZ = 16000; // what /ws/chat's audio parts carry (float32 mono)
  const MIC_MAX_S = 45; // base64 float32 at 16 kHz is ~85 KB/s: 45 s stay under the 4 MiB message cap

  const st = {
    key: sessionStorage.getItem(KEY_STORAGE) || "",
    ws: null,
    wsOpen: null,
    phase: "idle",
    via: "generate", // or "chat": the running reply comes from /ws/chat (spoken)
    messages: [], // chat history: [{role, content}]
    turns: [], // what the conversation view shows, as saved: [{kind: user|prompt|reply, role, text}]
    reply: null, // the reply being shown: {el, textEl, mdEl, marksEl, turn, text, numTokens, ...}
    lastPrompt: null, // {prompt, userText, mode, messages}
    lastRequestId: null,
    generation: 0,
    numMarks: 0,
    pendingModify: [], // parameter patches sent, oldest first, awaiting the server's ack
    sentAtMs: 0,
  };

  // ------------------------------------------------------------------ small helpers
  function b64url(text) {
    const bytes = new TextEncoder().encode(text);
    let binary = "";
    for (const b of bytes) binary += String.fromCharCode(b);
    return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function authHeaders() {
    return st.key ? { Authorization: "Bearer " + st.key } : {};
  }

  function wsProtocols() {
    return st.key ? ["rill", "rill.key." + b64url(st.key)] : [];
  }

  function wsUrl(path) {
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + path;
  }

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function fmt(value, digits) {
    return Number.isFinite(value) ? value.toFixed(digits) : "–";
  }

  // ------------------------------------------------------------------ page state
  function setPhase(phase) {
    st.phase = phase;
    render();
  }

  function render() {
    const d = app.dataset;
    d.state = st.phase;
    d.tokens = String(st.reply ? st.reply.numTokens : 0);
    d.generation = String(st.generation);
    d.modifyMarks = String(st.numMarks);
    d.modifyPending = String(st.pendingModify.length);
    $("fig-state").textContent = st.phase;
    $("fig-tokens").textContent = d.tokens;
    const running = RUNNING.has(st.phase);
    const controllable = CONTROLLABLE.has(st.phase) && st.via === "generate";
    setEnabled("btn-send", !running && mic.phase === "idle");
    setEnabled("btn-mic", !running && (mic.phase === "idle" || mic.phase === "recording"));
    setEnabled("btn-stop", running);
    setEnabled("btn-pause", controllable && st.phase !== "paused");
    setEnabled("btn-resume", controllable && st.phase === "paused");
    setEnabled("btn-regenerate", (controllable || (!running && st.lastPrompt !== null)));
    const canRate = st.lastRequestId !== null && st.via === "generate";
    setEnabled("btn-up", canRate);
    setEnabled("btn-down", canRate);
    if (st.phase !== "waiting") {
      $("fig-queue").textContent = "–";
      app.dataset.queuePosition = "";
    }
  }

  // aria-disabled instead of disabled: the button stays in the tab order, so keyboard users
  // can still reach it and hear why it does nothing right now.
  function setEnabled(id, enabled) {
    $(id).setAttribute("aria-disabled", enabled ? "false" : "true");
  }

  function isEnabled(id) {
    return $(id).getAttribute("aria-disabled") !== "true";
  }

  function showError(err) {
    $("error").hidden = false;
    $("error-type").textContent = err.error || "error";
    let message = err.message || "";
    if (err.field) message += " (field: " + err.field + ")";
    $("error-message").textContent = message;
    let recovery = err.recoverable ? "recoverable" : "not recoverable";
    if (err.recovery_action) recovery += ": " + err.recovery_action;
    $("error-recoverable").textContent = "[" + recovery + "]";
    app.dataset.error = err.error || "error";
  }

  function clearError() {
    $("error").hidden = true;
    app.dataset.error = "";
  }

  // ------------------------------------------------------------------ Markdown
  // marked turns the reply into HTML and DOMPurify turns that into DOM nodes (RETURN_DOM_FRAGMENT:
  // no HTML string is ever assigned to the page). Raw HTML inside the text is escaped by the
  // renderer, so a reply that writes <script> shows it as text; the sanitizer's allow-list is
  // the second wall. It keeps only what Markdown makes, without images (a reply must not make the
  // browser fetch anything) or form fields, and links only to http(s) and mailto.
  const MD_TAGS = ["p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "del", "code", "pre",
    "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td"];
  const MD_ATTRS = ["href", "title", "start", "class", "align"];
  const PURIFY = { ALLOWED_TAGS: MD_TAGS, ALLOWED_ATTR: MD_ATTRS, ALLOWED_URI_REGEXP: /^(?:https?:|mailto:)/i,
    RETURN_DOM_FRAGMENT: true };
  const HTML_ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => HTML_ESCAPES[c]);
  const markdown = window.marked && window.DOMPurify ? new window.marked.Marked({ gfm: true, breaks: true }) : null;
  if (markdown) markdown.use({ renderer: { html: ({ text }) => escapeHtml(text) } });

  // The reply as sanitized DOM nodes: code blocks get a copy button, links open in a new tab.
  // Without the vendored libraries (a failed load) the text is shown as it is.
  function renderMarkdown(text) {
    if (!markdown) {
      const fragment = document.createDocumentFragment();
      fragment.appendChild(el("p", "plain", text));
      return fragment;
    }
    const fragment = window.DOMPurify.sanitize(markdown.parse(text), PURIFY);
    for (const link of fragment.querySelectorAll("a")) {
      link.target = "_blank";
      link.rel = "noopener noreferrer";
    }
    for (const pre of fragment.querySelectorAll("pre")) {
      const box = el("div", "codeblock");
      pre.replaceWith(box);
      const copy = el("button", "copy", "Copy");
      copy.type = "button";
      copy.setAttribute("aria-label", "Copy code");
      box.append(copy, pre);
    }
    return fragment;
  }

  async function copyCode(button) {
    const code = button.parentElement.querySelector("pre");
    try {
      await navigator.clipboard.writeText(code ? code.textContent.replace(/\n$/, "") : ""); // marked ends it with one
      button.textContent = "Copied";
    } catch (exc) {
      button.textContent = "Copy failed";
    }
    button.dataset.copied = button.textContent;
  }

  function renderReplyMarkdown(reply) {
    if (reply.mdTimer !== null) {
      clearTimeout(reply.mdTimer);
      reply.mdTimer = null;
    }
    reply.mdEl.replaceChildren(renderMarkdown(reply.text));
    reply.el.dataset.rendered = String(reply.text.length);
  }

  // Re-rendering the whole reply on every token would be quadratic in a long reply; at most
  // every MARKDOWN_THROTTLE_MS it is not, and finishReply renders the last state at once.
  function scheduleMarkdown(reply) {
    if (reply.mdTimer === null) reply.mdTimer = setTimeout(() => renderReplyMarkdown(reply), MARKDOWN_THROTTLE_MS);
  }

  function updateViewMode() {
    const markdownOn = $("opt-markdown").checked && !$("opt-token-view").checked;
    $("conversation").classList.toggle("md-view", markdownOn);
    $("conversation").classList.toggle("token-view", $("opt-token-view").checked);
  }

  // ------------------------------------------------------------------ conversation view
  // kind: "user" (a chat turn), "prompt" (a raw prompt) or "reply".
  function addTurn(kind, role, text) {
    const turn = el("div", "turn " + (kind === "reply" ? "reply" : "user"));
    turn.appendChild(el("div", "role", role));
    const body = el("div", "text", text);
    turn.appendChild(body);
    $("conversation").appendChild(turn);
    const saved = { kind, role, text };
    st.turns.push(saved);
    scrollDown();
    return { el: turn, textEl: body, saved };
  }

  function addReplyTurn(role, text) {
    const view = addTurn("reply", role, "");
    const reply = { el: view.el, textEl: view.textEl, saved: view.saved, mdEl: el("div", "md"),
      marksEl: el("div", "marks"), text: "", mdTimer: null, numTokens: 0, firstMs: null, lastMs: null, firstAtMs: null };
    view.el.append(reply.mdEl, reply.marksEl);
    if (text) {
      reply.text = text;
      reply.textEl.textContent = text;
      renderReplyMarkdown(reply);
    }
    return reply;
  }

  function newReply(role) {
    st.reply = addReplyTurn(role, "");
    $("fig-ttft").textContent = "–";
    $("fig-tps").textContent = "–";
    render();
  }

  function resetReply() {
    if (!st.reply) return;
    st.reply.textEl.replaceChildren();
    st.reply.marksEl.replaceChildren();
    st.reply.text = "";
    renderReplyMarkdown(st.reply);
    st.reply.numTokens = 0;
    st.reply.firstMs = st.reply.lastMs = st.reply.firstAtMs = null;
    st.reply.el.classList.remove("cancelled");
  }

  // ------------------------------------------------------------------ the saved conversation
  function saveConversation() {
    const saved = {
      version: 1,
      turns: st.turns,
      messages: st.messages.filter((m) => typeof m.content === "string"), // never audio
    };
    try {
      localStorage.setItem(CONVERSATION_STORAGE, JSON.stringify(saved));
      app.dataset.saved = String(saved.turns.length);
    } catch (exc) {
      app.dataset.saved = "failed"; // storage full or off: the conversation lives on in this tab
    }
  }

  function restoreConversation() {
    let saved;
    try {
      saved = JSON.parse(localStorage.getItem(CONVERSATION_STORAGE) || "null");
    } catch (exc) {
      saved = null;
    }
    if (!saved || saved.version !== 1 || !Array.isArray(saved.turns) || !Array.isArray(saved.messages)) return;
    const isText = (v) => typeof v === "string";
    for (const turn of saved.turns) {
      if (!turn || !isText(turn.role) || !isText(turn.text)) continue;
      if (turn.kind === "reply") addReplyTurn(turn.role, turn.text);
      else addTurn(turn.kind === "prompt" ? "prompt" : "user", turn.role, turn.text);
    }
    st.messages = saved.messages.filter((m) => m && isText(m.role) && isText(m.content))
      .map((m) => ({ role: m.role, content: m.content }));
    app.dataset.restored = String(st.turns.length);
  }

  function newChat() {
    if (RUNNING.has(st.phase) || mic.phase !== "idle") return;
    st.messages = [];
    st.turns = [];
    st.reply = null;
    st.lastPrompt = null;
    $("conversation").replaceChildren();
    clearError();
    try {
      localStorage.removeItem(CONVERSATION_STORAGE);
    } catch (exc) {
      // storage off: nothing was saved
    }
    app.dataset.saved = "0";
    render();
  }

  function scrollDown() {
    const box = $("conversation");
    box.scrollTop = box.scrollHeight;
  }

  // Logprob → colour: green for likely tokens, red for unlikely ones.
  function logprobColour(logprob) {
    const p = Math.exp(Math.max(-20, Math.min(0, logprob)));
    const hue = Math.round(120 * p);
    return "hsla(" + hue + ", 80%, 55%, 0.35)";
  }

  function appendToken(text, logprobs, timing) {
    const reply = st.reply;
    if (!reply) return;
    const span = el("span", "tok", text);
    if (logprobs && logprobs.length) {
      const chosen = logprobs[0];
      span.dataset.logprob = String(chosen.logprob);
      span.style.setProperty("--lp-bg", logprobColour(chosen.logprob));
      const alts = logprobs.slice(1).map((a) => JSON.stringify(a.token) + " " + Math.exp(a.logprob).toFixed(3));
      span.title = "p=" + Math.exp(chosen.logprob).toFixed(3) + (alts.length ? "\nalternatives: " + alts.join(", ") : "");
    }
    reply.textEl.appendChild(span);
    reply.text += text;
    scheduleMarkdown(reply);
    reply.numTokens += 1;
    const now = performance.now();
    if (reply.firstAtMs === null) {
      reply.firstAtMs = now;
      const ttft = timing ? timing.total_ms : now - st.sentAtMs;
      $("fig-ttft").textContent = fmt(ttft, 0) + " ms";
    }
    if (timing) {
      if (reply.firstMs === null) reply.firstMs = timing.total_ms;
      reply.lastMs = timing.total_ms;
    } else {
      if (reply.firstMs === null) reply.firstMs = now;
      reply.lastMs = now;
    }
    if (reply.numTokens > 1 && reply.lastMs > reply.firstMs) {
      $("fig-tps").textContent = fmt((reply.numTokens - 1) * 1000 / (reply.lastMs - reply.firstMs), 1);
    }
    scrollDown();
  }

  // The server acknowledged a modify: its values apply from the next token on, so the mark
  // goes where the next token will be.
  function addModifyMark(patch, inForce) {
    if (!st.reply) return;
    const names = Object.keys(patch || {});
    const label = names.length ? names.map((n) => n + "=" + inForce[n]).join(", ") : "parameters changed";
    const mark = el("span", "mark", "\u2699 " + label);
    mark.setAttribute("role", "note");
    mark.dataset.atToken = String(st.reply.numTokens);
    mark.dataset.params = JSON.stringify(inForce || {});
    mark.title = "from token " + (st.reply.numTokens + 1) + " on: " + label;
    st.reply.textEl.appendChild(mark);
    // The Markdown view cannot place a mark between tokens: it lists them under the reply.
    st.reply.marksEl.appendChild(el("span", "mark-note", "\u2699 " + label + " from token " + (st.reply.numTokens + 1)));
    st.numMarks += 1;
  }

  // ------------------------------------------------------------------ parameters
  function readParam(name) {
    const raw = $("p-" + name).value.trim();
    if (raw === "") return undefined;
    const value = INT_PARAMS.has(name) ? parseInt(raw, 10) : parseFloat(raw);
    return Number.isFinite(value) ? value : undefined;
  }

  function currentParameters() {
    const params = {};
    for (const name of PARAMS) {
      const value = readParam(name);
      if (value !== undefined) params[name] = value;
    }
    if ($("p-ignore_eos").checked) params.ignore_eos = true;
    return params;
  }

  function onParamChange(event) {
    const name = event.target.dataset.param;
    if (!CONTROLLABLE.has(st.phase) || st.via !== "generate") return; // applies to the next reply
    const value = readParam(name);
    if (value === undefined) return;
    const patch = {};
    patch[name] = value;
    st.pendingModify.push(patch);
    send({ type: "control", action: "modify", parameters: patch });
    render();
  }

  // ------------------------------------------------------------------ /generate socket
  function connect() {
    if (st.ws && st.ws.readyState <= WebSocket.OPEN) return st.wsOpen;
    const ws = new WebSocket(wsUrl("/generate"), wsProtocols());
    st.ws = ws;
    st.wsOpen = new Promise((resolve, reject) => {
      ws.onopen = () => {
        app.dataset.connected = "true";
        resolve(ws);
      };
      ws.onerror = () => reject(new Error("connection failed"));
    });
    ws.onmessage = (event) => {
      let msg;
      try {
        msg = JSON.parse(event.data);
      } catch (exc) {
        return;
      }
      if (ws === st.ws) handle(msg);
    };
    ws.onclose = (event) => {
      if (ws !== st.ws) return;
      app.dataset.connected = "false";
      st.ws = null;
      if (RUNNING.has(st.phase) && st.via === "generate") {
        showError({ error: "connection_closed", message: "the connection closed (code " + event.code + ")",
          recoverable: true, recovery_action: "send again" });
        setPhase("idle");
      }
    };
    return st.wsOpen;
  }

  function send(msg) {
    if (st.ws && st.ws.readyState === WebSocket.OPEN) st.ws.send(JSON.stringify(msg));
  }

  // Why a handshake failed: the browser hides the HTTP status, so ask over plain HTTP.
  async function explainRefusal() {
    try {
      const answer = await fetch("/v1/models", { headers: authHeaders() });
      if (answer.status === 401) {
        return { error: "unauthorized", message: "the server needs an API key, or the key entered is wrong",
          recoverable: true, recovery_action: "enter the key above" };
      }
      if (answer.status === 403) {
        const body = await answer.json();
        return { error: "forbidden", message: body.error ? body.error.message : "refused", recoverable: false };
      }
    } catch (exc) {
      // fall through: the server is not reachable at all
    }
    return { error: "connection_failed", message: "could not connect to the server", recoverable: true,
      recovery_action: "retry" };
  }

  const HANDLERS = {
    init(msg) {
      st.generation += 1;
      st.lastRequestId = msg.request_id;
      showModel(msg.model);
      $("fig-loading-wrap").hidden = true;
      app.dataset.finishReason = "";
      setPhase("waiting");
    },
    token(msg) {
      if (st.phase === "waiting") st.phase = "generating";
      appendToken(msg.token, msg.logprobs, msg.timing);
      render();
    },
    completion(msg) {
      finishReply(msg.finish_reason, msg.generated_text);
    },
    error(msg) {
      showError(msg);
      if (msg.error === "invalid_request" && CONTROLLABLE.has(st.phase)) {
        // A refused control message (a bad modify value, say): the reply goes on.
        if (msg.field && msg.field.startsWith("parameters")) st.pendingModify.shift();
        render();
        return;
      }
      if (RUNNING.has(st.phase)) finishReply("error", msg.generated_text);
    },
    status(msg) {
      const handler = STATUS_HANDLERS[msg.operation];
      if (handler) handler(msg);
    },
  };

  const STATUS_HANDLERS = {
    model_loading(msg) {
      $("fig-loading-wrap").hidden = false;
      $("fig-loading").value = msg.progress || 0;
      $("fig-loading-text").textContent = fmt(msg.progress, 0) + "%" +
        (msg.eta_seconds != null ? ", about " + fmt(msg.eta_seconds, 0) + " s left" : "");
      setPhase("loading");
    },
    queued(msg) {
      if (st.phase !== "waiting") return; // a late notice: the reply already runs
      $("fig-queue").textContent = msg.position + " of " + msg.queue_length;
      app.dataset.queuePosition = String(msg.position);
    },
    paused() {
      setPhase("paused");
    },
    resumed() {
      setPhase("generating");
    },
    modified(msg) {
      const patch = st.pendingModify.shift();
      addModifyMark(patch, msg.parameters || {});
      render();
    },
    regenerating() {
      app.dataset.regeneratedFrom = String(st.reply ? st.reply.numTokens : 0);
      resetReply();
      st.pendingModify = [];
      setPhase("waiting");
    },
    feedback_received(msg) {
      app.dataset.feedbackId = String(msg.feedback_id);
      $("feedback-status").textContent = "feedback #" + msg.feedback_id + " stored, thank you";
    },
  };

  function handle(msg) {
    const handler = HANDLERS[msg.type];
    if (handler) handler(msg);
  }

  function finishReply(reason, text) {
    app.dataset.finishReason = reason || "";
    if (st.reply) {
      if (reason === "cancelled") st.reply.el.classList.add("cancelled");
      renderReplyMarkdown(st.reply);
      st.reply.saved.text = st.reply.text;
    }
    if (st.lastPrompt && st.lastPrompt.mode === "chat" && reason !== "error" && typeof text === "string") {
      st.messages.push({ role: "assistant", content: text });
    }
    st.pendingModify = [];
    saveConversation();
    setPhase(reason === "error" ? "error" : "done");
  }

  // ------------------------------------------------------------------ starting a reply
  async function chatPrompt(messages) {
    const answer = await fetch("/playground/prompt", {
      method: "POST",
      headers: Object.assign({ "Content-Type": "application/json" }, authHeaders()),
      body: JSON.stringify({ messages }),
    });
    const body = await answer.json().catch(() => ({}));
    if (!answer.ok) {
      const detail = body.error || {};
      throw { error: detail.code || "http_" + answer.status, message: detail.message || "the chat template failed",
        recoverable: true, recovery_action: answer.status === 401 ? "enter the API key above" : "use raw prompt mode" };
    }
    return body.prompt;
  }

  async function startReply(prompt) {
    st.via = "generate";
    newReply("assistant");
    setPhase("starting");
    try {
      await connect();
    } catch (exc) {
      showError(await explainRefusal());
      setPhase("error");
      return;
    }
    st.sentAtMs = performance.now();
    send({
      type: "config",
      prompt,
      parameters: currentParameters(),
      options: { stream: true, include_logprobs: true, include_timing: true },
    });
  }

  async function onSend(event) {
    event.preventDefault();
    if (!isEnabled("btn-send")) return;
    const text = $("prompt").value;
    if (!text.trim()) return;
    clearError();
    const mode = document.querySelector("input[name=mode]:checked").value;
    $("prompt").value = "";
    $("feedback-status").textContent = "";
    addTurn(mode === "chat" ? "user" : "prompt", mode === "chat" ? "user" : "prompt", text);
    if (mode === "chat") {
      st.messages.push({ role: "user", content: text });
      if ($("opt-speak").checked) {
        st.lastPrompt = { prompt: null, mode, messages: st.messages.slice() };
        startChatReply(st.messages.slice(), null);
        return;
      }
      let prompt;
      try {
        setPhase("starting");
        prompt = await chatPrompt(st.messages);
      } catch (err) {
        st.messages.pop();
        showError(err.error ? err : { error: "error", message: String(err), recoverable: true });
        setPhase("error");
        return;
      }
      st.lastPrompt = { prompt, mode };
      startReply(prompt);
    } else {
      st.lastPrompt = { prompt: text, mode };
      startReply(text);
    }
  }

  function onRegenerate() {
    if (!isEnabled("btn-regenerate")) return;
    clearError();
    if (CONTROLLABLE.has(st.phase)) {
      send({ type: "control", action: "regenerate" });
      return;
    }
    const last = st.lastPrompt;
    if (!last) return;
    // A finished reply: ask again with the same prompt (the old reply leaves the history).
    if (last.mode === "chat" && st.messages.length && st.messages[st.messages.length - 1].role === "assistant") {
      st.messages.pop();
    }
    if (last.messages) {
      startChatReply(last.messages, null);
    } else {
      startReply(last.prompt);
    }
  }

  function onControl(action, buttonId) {
    if (!isEnabled(buttonId)) return;
    if (action === "stop" && st.via === "chat") {
      stopSpokenReply();
      return;
    }
    send({ type: "control", action });
  }

  function onRate(rating, buttonId) {
    if (!isEnabled(buttonId)) return;
    const msg = { type: "feedback", rating, request_id: st.lastRequestId };
    const text = $("feedback-text").value.trim();
    if (text) msg.text = text;
    if (st.reply) msg.position = st.reply.numTokens;
    $("feedback-status").textContent = "sending feedback…";
    connect().then(() => send(msg)).catch(async () => showError(await explainRefusal()));
  }

  // ------------------------------------------------------------------ spoken replies (/ws/chat)
  const speech = { ctx: null, at: 0, ws: null, heard: null };

  function playPcm(base64) {
    if (!speech.ctx) return;
    const raw = atob(base64);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    const samples = new Float32Array(bytes.buffer, 0, Math.floor(bytes.length / 4));
    if (!samples.length) return;
    const buffer = speech.ctx.createBuffer(1, samples.length, 24000);
    buffer.copyToChannel(samples, 0);
    const source = speech.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(speech.ctx.destination);
    speech.at = Math.max(speech.at, speech.ctx.currentTime + 0.05);
    source.start(speech.at);
    speech.at += buffer.duration;
    app.dataset.audioChunks = String(Number(app.dataset.audioChunks || "0") + 1);
  }

  // A reply over /ws/chat: spoken when "Speak replies" is on; `heard` is the user turn of a
  // recorded question ({textEl, saved}), whose words arrive in the server's transcript message.
  function startChatReply(messages, heard) {
    const speak = $("opt-speak").checked;
    st.via = "chat";
    st.lastRequestId = null;
    newReply(speak ? "assistant (spoken)" : "assistant");
    setPhase("starting");
    if (speak) {
      try {
        speech.ctx = speech.ctx || new AudioContext({ sampleRate: 24000 });
        speech.ctx.resume();
      } catch (exc) {
        speech.ctx = null;
        $("speak-status").textContent = "this browser cannot play audio; text only";
      }
    }
    const ws = new WebSocket(wsUrl("/ws/chat"), wsProtocols());
    speech.ws = ws;
    speech.heard = heard;
    let isOpen = false;
    ws.onopen = () => {
      isOpen = true;
      const p = currentParameters();
      const generation = { max_new_tokens: p.max_tokens || 256 };
      for (const name of ["temperature", "top_p", "top_k", "repetition_penalty", "seed"]) {
        if (p[name] !== undefined) generation[name] = p[name];
      }
      st.sentAtMs = performance.now();
      ws.send(JSON.stringify({ messages, streaming: true, generation, tts: { enabled: speak } }));
    };
    ws.onmessage = (event) => {
      const msg = JSON.parse(event.data);
      if (msg.type === "transcript") {
        if (heard) showTranscript(heard, msg);
      } else if (msg.type === "queued" || msg.type === "queue_update") {
        setPhase("waiting");
        $("fig-queue").textContent = msg.position + " of " + msg.queue_length;
      } else if (msg.type === "queue_done" || msg.type === "prefill_done") {
        if (st.phase !== "generating") setPhase("waiting");
      } else if (msg.type === "chunk") {
        if (msg.text_delta) {
          if (st.phase !== "generating") st.phase = "generating";
          appendToken(msg.text_delta, null, null);
        }
        if (msg.audio_data) playPcm(msg.audio_data);
        render();
      } else if (msg.type === "done") {
        if (msg.audio_data) playPcm(msg.audio_data);
        finishReply("stop", msg.text);
      } else if (msg.type === "error") {
        showError({ error: "chat_error", message: msg.error, recoverable: false });
        if (heard && !heard.isHeard) forgetRecording(heard);
        finishReply("error");
      }
    };
    ws.onclose = async () => {
      if (speech.ws !== ws) return;
      speech.ws = null;
      if (!isOpen) {
        showError(await explainRefusal());
        if (heard && !heard.isHeard) forgetRecording(heard);
        setPhase("error");
      } else if (RUNNING.has(st.phase)) {
        if (heard && !heard.isHeard) forgetRecording(heard);
        finishReply("cancelled", st.reply ? st.reply.text : "");
      }
    };
  }

  function stopSpokenReply() {
    const ws = speech.ws;
    speech.ws = null;
    if (ws) ws.close();
    if (speech.ctx) {
      speech.ctx.close();
      speech.ctx = null;
      speech.at = 0;
    }
    if (speech.heard && !speech.heard.isHeard) forgetRecording(speech.heard);
    finishReply("cancelled", st.reply ? st.reply.text : "");
  }

  // ------------------------------------------------------------------ microphone
  // Capture at the device's rate through an AudioWorklet (mic-worklet.js, mono), resample to
  // 16 kHz with an OfflineAudioContext (the browser's own band-limited resampler) when the
  // user stops, and send the samples as one /ws/chat audio part: base64 of float32
  // little-endian, sample_rate 16000. The server's transcript message fills in the user turn.
  const mic = { phase: "idle", ctx: null, stream: null, node: null, chunks: [], numFrames: 0, flushed: null };

  function setMicPhase(phase, status) {
    mic.phase = phase;
    app.dataset.mic = phase;
    $("btn-mic-label").textContent = phase === "recording" ? "Stop and send" : "Record";
    if (status !== undefined) $("mic-status").textContent = status;
    render();
  }

  async function startRecording() {
    if (!navigator.mediaDevices || !window.AudioWorkletNode) {
      setMicPhase("idle", "recording needs a browser with Web Audio, on https or localhost");
      return;
    }
    setMicPhase("starting", "asking for the microphone…");
    try {
      mic.stream = await navigator.mediaDevices.getUserMedia({
        audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
      });
      mic.ctx = new AudioContext();
      await mic.ctx.audioWorklet.addModule("/playground/static/mic-worklet.js");
    } catch (exc) {
      releaseMic();
      setMicPhase("idle", "no microphone: " + (exc && exc.message ? exc.message : String(exc)));
      return;
    }
    mic.chunks = [];
    mic.numFrames = 0;
    const source = mic.ctx.createMediaStreamSource(mic.stream);
    mic.node = new AudioWorkletNode(mic.ctx, "rill-mic", { numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1] });
    let lastBlock;
    mic.flushed = new Promise((resolve) => { lastBlock = resolve; });
    mic.node.port.onmessage = (event) => {
      mic.chunks.push(event.data.samples);
      mic.numFrames += event.data.samples.length;
      const seconds = mic.numFrames / mic.ctx.sampleRate;
      app.dataset.micSeconds = seconds.toFixed(2);
      if (event.data.last) lastBlock();
      else if (seconds >= MIC_MAX_S && mic.phase === "recording") stopRecording();
    };
    source.connect(mic.node);
    mic.node.connect(mic.ctx.destination); // the node writes silence; connected, it is pulled
    await mic.ctx.resume();
    app.dataset.micSeconds = "0.00";
    setMicPhase("recording", "recording… (up to " + MIC_MAX_S + " s)");
  }

  function releaseMic() {
    if (mic.stream) for (const track of mic.stream.getTracks()) track.stop();
    if (mic.ctx) mic.ctx.close();
    mic.stream = mic.ctx = mic.node = null;
  }

  async function stopRecording() {
    setMicPhase("encoding", "preparing the recording…");
    mic.node.port.postMessage("flush");
    await mic.flushed;
    const rate = mic.ctx.sampleRate;
    const chunks = mic.chunks;
    mic.chunks = [];
    releaseMic();
    const samples = await resample(chunks, rate, MIC_RATE_HZ);
    if (samples.length < MIC_RATE_HZ / 10) {
      setMicPhase("idle", "nothing was recorded");
      return;
    }
    setMicPhase("idle", "sent " + (samples.length / MIC_RATE_HZ).toFixed(1) + " s of audio");
    sendRecording(samples);
  }

  async function resample(chunks, fromHz, toHz) {
    let numFrames = 0;
    for (const chunk of chunks) numFrames += chunk.length;
    const joined = new Float32Array(numFrames);
    let at = 0;
    for (const chunk of chunks) {
      joined.set(chunk, at);
      at += chunk.length;
    }
    if (fromHz === toHz || numFrames === 0) return joined;
    const offline = new OfflineAudioContext(1, Math.max(1, Math.round(numFrames * toHz / fromHz)), toHz);
    const buffer = offline.createBuffer(1, numFrames, fromHz);
    buffer.copyToChannel(joined, 0);
    const source = offline.createBufferSource();
    source.buffer = buffer;
    source.connect(offline.destination);
    source.start();
    return (await offline.startRendering()).getChannelData(0);
  }

  function pcmBase64(samples) {
    // Float32Array's bytes are the platform's order, little-endian on every browser platform.
    const bytes = new Uint8Array(samples.buffer, samples.byteOffset, samples.byteLength);
    let binary = "";
    const STEP = 0x8000; // String.fromCharCode takes its arguments on the stack
    for (let i = 0; i < bytes.length; i += STEP) binary += String.fromCharCode.apply(null, bytes.subarray(i, i + STEP));
    return btoa(binary);
  }

  // The question goes out as audio; once the server says what it heard, the history keeps
  // those words instead (the next turns and the saved conversation carry text, not audio).
  function sendRecording(samples) {
    clearError();
    $("feedback-status").textContent = "";
    document.querySelector("input[name=mode][value=chat]").checked = true;
    const view = addTurn("user", "user (spoken)", "(transcribing…)");
    const part = { type: "audio", data: pcmBase64(samples), sample_rate: MIC_RATE_HZ };
    st.messages.push({ role: "user", content: [part] });
    const messages = st.messages.slice();
    st.lastPrompt = { prompt: null, mode: "chat", messages };
    app.dataset.transcript = "";
    startChatReply(messages, { textEl: view.textEl, saved: view.saved, isHeard: false, index: st.messages.length - 1 });
  }

  function showTranscript(heard, msg) {
    heard.isHeard = true;
    heard.textEl.textContent = msg.text;
    heard.saved.text = msg.text;
    const asText = { role: "user", content: msg.text };
    st.messages[heard.index] = asText;
    if (st.lastPrompt && st.lastPrompt.messages) st.lastPrompt.messages[heard.index] = asText;
    app.dataset.transcript = msg.text;
  }

  // Nothing was heard (an error, a refusal, a stop): the recording leaves the history.
  function forgetRecording(heard) {
    st.messages.splice(heard.index, 1);
    st.turns = st.turns.filter((turn) => turn !== heard.saved);
    heard.textEl.textContent = "(not heard)";
    heard.isHeard = true; // handled
    st.lastPrompt = null;
  }

  function onMic() {
    if (!isEnabled("btn-mic")) return;
    if (mic.phase === "idle") startRecording();
    else if (mic.phase === "recording") stopRecording();
  }

  // ------------------------------------------------------------------ model name
  function showModel(name) {
    $("model-name").textContent = "model: " + name;
    app.dataset.model = name;
  }

  // /v1/models lists the served model first. Until it answers (a refused key, a model still
  // loading: retried), the name says why it is not known yet; a reply's init names it too.
  async function loadModelName() {
    let answer;
    try {
      answer = await fetch("/v1/models", { headers: authHeaders() });
    } catch (exc) {
      $("model-name").textContent = "model: (server unreachable)";
      return;
    }
    await showModelFrom(answer);
  }

  async function showModelFrom(answer) {
    if (answer.status === 401) {
      if (!app.dataset.model) $("model-name").textContent = "model: (enter the API key)";
      return;
    }
    const body = answer.ok ? await answer.json().catch(() => null) : null;
    const first = body && Array.isArray(body.data) && body.data[0];
    if (first && typeof first.id === "string") {
      showModel(first.id);
    } else if (app.dataset.model) {
      // a reply's init already named it
    } else if (answer.status === 503) {
      $("model-name").textContent = "model: (loading)";
      setTimeout(loadModelName, 2000);
    } else {
      $("model-name").textContent = "model: (unknown: /v1/models answered " + answer.status + ")";
    }
  }

  // ------------------------------------------------------------------ API key
  async function onKey(event) {
    event.preventDefault();
    st.key = $("api-key").value.trim();
    if (st.key) sessionStorage.setItem(KEY_STORAGE, st.key);
    else sessionStorage.removeItem(KEY_STORAGE);
    $("api-key").value = "";
    $("api-key").placeholder = st.key ? "key set (enter another to replace)" : "only if the server needs one";
    if (st.ws && !RUNNING.has(st.phase)) st.ws.close(); // the next reply connects with the new key
    const answer = await fetch("/v1/models", { headers: authHeaders() }).catch(() => null);
    $("key-status").textContent = !answer ? "server unreachable"
      : answer.status === 401 ? "key refused" : answer.ok ? (st.key ? "key accepted" : "no key needed") : "";
    app.dataset.keyStatus = $("key-status").textContent;
    if (answer && answer.ok) await showModelFrom(answer);
  }

  // ------------------------------------------------------------------ dashboard
  // Every 2 s while the dashboard shows, every 10 s otherwise (history for when it opens,
  // without a /metrics line in the server's access log every other second).
  const DASH_PERIOD_MS = 2000;
  const DASH_BACKGROUND_PERIOD_MS = 10000;
  const DASH_WINDOW_MS = 5 * 60 * 1000;
  const dash = { samples: [], lastTotal: null, lastAt: null };

  function parseMetrics(text) {
    const values = {};
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const match = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
      if (!match) continue;
      const value = parseFloat(match[3]);
      if (Number.isFinite(value)) values[match[1]] = (values[match[1]] || 0) + value;
    }
    return values;
  }

  async function pollMetrics() {
    let text;
    try {
      const answer = await fetch("/metrics", { headers: authHeaders() });
      if (!answer.ok) {
        $("dash-status").textContent = answer.status === 401 ? "(needs the API key)" : "(/metrics answered " + answer.status + ")";
        return;
      }
      text = await answer.text();
    } catch (exc) {
      $("dash-status").textContent = "(server unreachable)";
      return;
    }
    $("dash-status").textContent = "";
    const m = parseMetrics(text);
    const now = performance.now();
    const total = m.rill_generation_tokens_total;
    let tps = 0;
    if (total !== undefined && dash.lastTotal !== null && now > dash.lastAt) {
      tps = Math.max(0, (total - dash.lastTotal) * 1000 / (now - dash.lastAt));
    }
    dash.lastTotal = total !== undefined ? total : null;
    dash.lastAt = now;
    dash.samples.push({
      at: now,
      running: m.rill_num_requests_running || 0,
      waiting: m.rill_num_requests_waiting || 0,
      kv: 100 * (m.rill_kv_cache_usage_perc || 0),
      tps,
    });
    while (dash.samples.length && dash.samples[0].at < now - DASH_WINDOW_MS) dash.samples.shift();
    app.dataset.dashSamples = String(dash.samples.length);
    drawDashboard();
  }

  function drawDashboard() {
    const last = dash.samples[dash.samples.length - 1];
    if (!last) return;
    $("val-running").textContent = String(last.running);
    $("val-waiting").textContent = String(last.waiting);
    $("val-kv").textContent = fmt(last.kv, 1) + " %";
    $("val-tps").textContent = fmt(last.tps, 1);
    if ($("view-dashboard").hidden) return;
    plot("plot-running", "running", 1, "");
    plot("plot-waiting", "waiting", 1, "");
    plot("plot-kv", "kv", 100, "%");
    plot("plot-tps", "tps", 10, "");
  }

  function plot(canvasId, field, minTop, unit) {
    const canvas = $(canvasId);
    const g = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height, padL = 40, padB = 16, padT = 8;
    const values = dash.samples.map((s) => s[field]);
    const top = Math.max(minTop, ...values) * 1.1;
    g.clearRect(0, 0, w, h);
    g.strokeStyle = "#d9d9de";
    g.fillStyle = "#62636a";
    g.font = "11px system-ui, sans-serif";
    g.beginPath();
    g.moveTo(padL, padT);
    g.lineTo(padL, h - padB);
    g.lineTo(w, h - padB);
    g.stroke();
    g.fillText(fmt(top, top < 10 ? 1 : 0) + unit, 2, padT + 8);
    g.fillText("0", 2, h - padB);
    g.fillText("-5 min", padL, h - 3);
    g.fillText("now", w - 24, h - 3);
    const now = performance.now();
    g.strokeStyle = "#2456c7";
    g.lineWidth = 2;
    g.beginPath();
    values.forEach((v, i) => {
      const x = w - (w - padL) * Math.min(1, (now - dash.samples[i].at) / DASH_WINDOW_MS);
      const y = h - padB - (h - padB - padT) * (v / top);
      if (i === 0) g.moveTo(x, y);
      else g.lineTo(x, y);
    });
    g.stroke();
    g.lineWidth = 1;
  }

  // ------------------------------------------------------------------ tabs
  function selectTab(name) {
    for (const tab of ["playground", "dashboard"]) {
      const selected = tab === name;
      $("tab-" + tab).setAttribute("aria-selected", String(selected));
      $("view-" + tab).hidden = !selected;
    }
    if (name === "dashboard") pollMetrics(); // a fresh sample now, not at the next background tick
    drawDashboard();
  }

  function onTabKey(event) {
    if (event.key === "ArrowRight" || event.key === "ArrowLeft") {
      const next = event.target.id === "tab-playground" ? "dashboard" : "playground";
      selectTab(next);
      $("tab-" + next).focus();
    }
  }

  // ------------------------------------------------------------------ wiring
  function init() {
    $("composer").addEventListener("submit", onSend);
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) onSend(event);
    });
    $("btn-stop").addEventListener("click", () => onControl("stop", "btn-stop"));
    $("btn-pause").addEventListener("click", () => onControl("pause", "btn-pause"));
    $("btn-resume").addEventListener("click", () => onControl("resume", "btn-resume"));
    $("btn-regenerate").addEventListener("click", onRegenerate);
    $("btn-up").addEventListener("click", () => onRate(1, "btn-up"));
    $("btn-down").addEventListener("click", () => onRate(-1, "btn-down"));
    $("feedback-form").addEventListener("submit", (event) => event.preventDefault());
    $("key-form").addEventListener("submit", onKey);
    for (const name of PARAMS) $("p-" + name).addEventListener("change", onParamChange);
    $("opt-token-view").addEventListener("change", updateViewMode);
    $("opt-markdown").addEventListener("change", updateViewMode);
    $("conversation").addEventListener("click", (event) => {
      const button = event.target.closest("button.copy");
      if (button) copyCode(button);
    });
    $("clear-chat").addEventListener("click", newChat);
    $("btn-mic").addEventListener("click", onMic);
    $("tab-playground").addEventListener("click", () => selectTab("playground"));
    $("tab-dashboard").addEventListener("click", () => selectTab("dashboard"));
    $("tab-playground").addEventListener("keydown", onTabKey);
    $("tab-dashboard").addEventListener("keydown", onTabKey);
    if (st.key) $("api-key").placeholder = "key set (enter another to replace)";
    app.dataset.mic = "idle";
    updateViewMode();
    restoreConversation();
    render();
    loadModelName();
    const poll = async () => {
      await pollMetrics();
      setTimeout(poll, $("view-dashboard").hidden ? DASH_BACKGROUND_PERIOD_MS : DASH_PERIOD_MS);
    };
    poll();
    app.dataset.ready = "true";
  }

  init();
})();

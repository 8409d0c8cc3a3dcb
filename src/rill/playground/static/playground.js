// rill playground: drives /generate over WebSocket (and /ws/chat for spoken replies), plots /metrics.
//
// Rules kept throughout: model output, server messages and user text only ever reach the page
// through textContent or title (never parsed as HTML), and every request goes to this page's own
// origin. The API key lives in sessionStorage and travels as a WebSocket subprotocol
// ("rill.key.<base64url>") or an Authorization header, never in a URL.
//
// Tests read the page's state from data attributes on #app: data-state, data-tokens,
// data-generation, data-modify-marks, data-finish-reason, data-feedback-id, data-error.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const app = $("app");
  const PARAMS = ["temperature", "top_p", "top_k", "max_tokens", "repetition_penalty", "seed"];
  const INT_PARAMS = new Set(["top_k", "max_tokens", "seed"]);
  const RUNNING = new Set(["starting", "loading", "waiting", "generating", "paused"]);
  const CONTROLLABLE = new Set(["waiting", "generating", "paused"]);
  const KEY_STORAGE = "rill.apiKey";

  const st = {
    key: sessionStorage.getItem(KEY_STORAGE) || "",
    ws: null,
    wsOpen: null,
    phase: "idle",
    via: "generate", // or "chat": the running reply comes from /ws/chat (spoken)
    messages: [], // chat history: [{role, content}]
    reply: null, // the reply being shown: {el, textEl, numTokens, firstMs, lastMs, firstAtMs}
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
    setEnabled("btn-send", !running);
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

  // ------------------------------------------------------------------ conversation view
  function addTurn(role, text, cls) {
    const turn = el("div", "turn " + cls);
    turn.appendChild(el("div", "role", role));
    const body = el("div", "text", text);
    turn.appendChild(body);
    $("conversation").appendChild(turn);
    scrollDown();
    return { el: turn, textEl: body };
  }

  function newReply(role) {
    const view = addTurn(role, "", "reply");
    st.reply = { el: view.el, textEl: view.textEl, numTokens: 0, firstMs: null, lastMs: null, firstAtMs: null };
    $("fig-ttft").textContent = "–";
    $("fig-tps").textContent = "–";
    render();
  }

  function resetReply() {
    if (!st.reply) return;
    st.reply.textEl.replaceChildren();
    st.reply.numTokens = 0;
    st.reply.firstMs = st.reply.lastMs = st.reply.firstAtMs = null;
    st.reply.el.classList.remove("cancelled");
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
      $("model-name").textContent = "model: " + msg.model;
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
    if (st.reply && reason === "cancelled") st.reply.el.classList.add("cancelled");
    if (st.lastPrompt && st.lastPrompt.mode === "chat" && reason !== "error" && typeof text === "string") {
      st.messages.push({ role: "assistant", content: text });
    }
    st.pendingModify = [];
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
    addTurn(mode === "chat" ? "user" : "prompt", text, "user");
    if (mode === "chat") {
      st.messages.push({ role: "user", content: text });
      if ($("opt-speak").checked) {
        st.lastPrompt = { prompt: null, mode, messages: st.messages.slice() };
        startSpokenReply(st.messages.slice());
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
      startSpokenReply(last.messages);
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
  const speech = { ctx: null, at: 0, ws: null };

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

  function startSpokenReply(messages) {
    st.via = "chat";
    st.lastRequestId = null;
    newReply("assistant (spoken)");
    setPhase("starting");
    try {
      speech.ctx = speech.ctx || new AudioContext({ sampleRate: 24000 });
      speech.ctx.resume();
    } catch (exc) {
      speech.ctx = null;
      $("speak-status").textContent = "this browser cannot play audio; text only";
    }
    const ws = new WebSocket(wsUrl("/ws/chat"), wsProtocols());
    speech.ws = ws;
    let isOpen = false;
    ws.onopen = () => {
      isOpen = true;
      const p = currentParameters();
      const generation = { max_new_tokens: p.max_tokens || 256 };
      for (const name of ["temperature", "top_p", "top_k", "repetition_penalty", "seed"]) {
        if (p[name] !== undefined) generation[name] = p[name];
      }
      st.sentAtMs = performance.now();
      ws.send(JSON.stringify({ messages, streaming: true, generation, tts: { enabled: true } }));
    };
    ws.onmessage = (event) => {
      const msg = JSON.parse(event.data);
      if (msg.type === "queued" || msg.type === "queue_update") {
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
        finishReply("error");
      }
    };
    ws.onclose = async () => {
      if (speech.ws !== ws) return;
      speech.ws = null;
      if (!isOpen) {
        showError(await explainRefusal());
        setPhase("error");
      } else if (RUNNING.has(st.phase)) {
        finishReply("cancelled", st.reply ? st.reply.textEl.textContent : "");
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
    finishReply("cancelled", st.reply ? st.reply.textEl.textContent : "");
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
    $("opt-token-view").addEventListener("change", (event) => {
      $("conversation").classList.toggle("token-view", event.target.checked);
    });
    $("clear-chat").addEventListener("click", () => {
      if (RUNNING.has(st.phase)) return;
      st.messages = [];
      st.reply = null;
      st.lastPrompt = null;
      $("conversation").replaceChildren();
      clearError();
      render();
    });
    $("tab-playground").addEventListener("click", () => selectTab("playground"));
    $("tab-dashboard").addEventListener("click", () => selectTab("dashboard"));
    $("tab-playground").addEventListener("keydown", onTabKey);
    $("tab-dashboard").addEventListener("keydown", onTabKey);
    if (st.key) $("api-key").placeholder = "key set (enter another to replace)";
    render();
    const poll = async () => {
      await pollMetrics();
      setTimeout(poll, $("view-dashboard").hidden ? DASH_BACKGROUND_PERIOD_MS : DASH_PERIOD_MS);
    };
    poll();
    app.dataset.ready = "true";
  }

  init();
})();

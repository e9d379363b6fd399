// streamfleet demo page: one WebSocket to this gateway's /v1/stream (reconnected when it
// closes), one request at a time from the form, tokens appended as they arrive; and the
// microphone, resampled by an AudioWorklet (mic-worklet.js) and streamed to
// /v1/audio/stream on a WebSocket of its own while the Mic button is on.
// A model with a chat template (GET /v1/models: "chat_template") chats: each message is
// sent as `messages` with the conversation's earlier turns (the replies as they were shown,
// a stopped one included), up to the history limit; a model without one completes the
// raw prompt.
// No build step, no dependencies, no requests anywhere but this origin.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const el = {
    form: $("form"), prompt: $("prompt"), model: $("model"), priority: $("priority"),
    maxTokens: $("max-tokens"), temperature: $("temperature"), apiKey: $("api-key"),
    ignoreEos: $("ignore-eos"), seed: $("seed"), generate: $("generate"), stop: $("stop"),
    chat: $("chat"), chatTemplate: $("chat-template"), promptLabel: $("prompt-label"), newChat: $("new-chat"),
    historyChars: $("history-chars"), conversation: $("conversation"), historyNote: $("history-note"),
    output: $("output"), status: $("status"), ttft: $("ttft"), tps: $("tps"), count: $("count"),
    queue: $("queue"), usage: $("usage"), error: $("error"), conn: $("conn"),
    mic: $("mic"), voiceStatus: $("voice-status"), voiceError: $("voice-error"), partial: $("partial"),
    finals: $("finals"),
  };

  const FALLBACK_MODELS = [{id: "tiny-gpt", chat_template: null, default: true}];  // no /v1/models: no chat
  const HISTORY_CHARS_DEFAULT = 6000;  // the conversation's characters sent (the #history-chars field)
  const RAW_PLACEHOLDER = "Once upon a time";
  const CHAT_PLACEHOLDER = "Ask something, e.g. What is the capital of Japan?  (Enter sends, Shift+Enter: new line)";
  const RECONNECT_MIN_MS = 250;
  const RECONNECT_MAX_MS = 8000;

  let ws = null;              // the current socket (open or opening)
  let reconnectDelay = RECONNECT_MIN_MS;
  let reconnectTimer = null;
  let pending = [];           // frames waiting for the socket to open: {frame, onSent}
  let seq = 0;                // request ids: r1, r2, ...
  let cur = null;             // the request in flight: {id, t0, tFirst, tLast, n, stopping, queuedOnly, chat}
  //                             (a chat request also: user, reply: its two turns, text: the reply so far)
  let models = new Map();     // model id -> its /v1/models entry ({chat_template, default, ...})
  let modelChosen = false;    // the user picked a model: a reload of the list keeps it
  let chatChosen = null;      // the user's own chat checkbox choice, for models that can chat
  // the conversation: {role: "user" | "assistant", content, node}, oldest first; the reply
  // being streamed joins it when it ends
  let turns = [];
  const finished = new Set(); // ids that already ended (late cancel errors for them are ignored)
  let renderQueued = false;

  // ---- connection --------------------------------------------------------------------
  function socketUrl(path) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const key = el.apiKey.value.trim();
    return `${scheme}//${location.host}${path}` + (key ? `?api_key=${encodeURIComponent(key)}` : "");
  }

  function setConn(state, text) {
    el.conn.dataset.state = state;
    el.conn.textContent = text;
  }

  function connect() {
    clearTimeout(reconnectTimer);
    reconnectTimer = null;
    setConn("connecting", "connecting…");
    const sock = new WebSocket(socketUrl("/v1/stream"));
    ws = sock;
    sock.onopen = () => {
      if (sock !== ws) return;
      reconnectDelay = RECONNECT_MIN_MS;
      setConn("open", "connected");
      const queued = pending;
      pending = [];
      for (const p of queued) sendNow(p.frame, p.onSent);
    };
    sock.onmessage = (ev) => {
      if (sock !== ws) return;
      let msg;
      try { msg = JSON.parse(ev.data); } catch (e) { return; }
      onFrame(msg);
    };
    sock.onclose = (ev) => {
      if (sock !== ws) return;   // a socket we replaced on purpose
      ws = null;
      if (cur && !cur.queuedOnly) {
        // the gateway cancels a closed socket's requests: this one is over
        showError({code: "connection_closed", status: ev.code,
                   message: `the WebSocket closed${ev.reason ? " (" + ev.reason + ")" : ""}; the request was cancelled`});
        finish("error");
      }
      const secs = (reconnectDelay / 1000).toFixed(reconnectDelay < 1000 ? 2 : 0);
      setConn("closed", `disconnected — retrying in ${secs} s`);
      reconnectTimer = setTimeout(connect, reconnectDelay);
      reconnectDelay = Math.min(reconnectDelay * 2, RECONNECT_MAX_MS);
    };
  }

  function reconnectNow() {
    if (ws) {
      const old = ws;
      ws = null;
      old.onclose = null;
      try { old.close(1000, "reconnecting"); } catch (e) { /* already closed */ }
      if (cur && !cur.queuedOnly) {
        showError({code: "connection_closed", message: "reconnected with a new API key; the request was cancelled"});
        finish("error");
      }
    }
    reconnectDelay = RECONNECT_MIN_MS;
    connect();
  }

  function sendNow(frame, onSent) {
    ws.send(JSON.stringify(frame));
    if (onSent) onSent();
  }

  function send(frame, onSent) {
    if (ws && ws.readyState === WebSocket.OPEN) sendNow(frame, onSent);
    else {
      pending.push({frame, onSent});
      if (!ws && !reconnectTimer) connect();
    }
  }

  // ---- models --------------------------------------------------------------------------
  async function loadModels() {
    let list = FALLBACK_MODELS;
    try {
      const key = el.apiKey.value.trim();
      const r = await fetch("/v1/models", {headers: key ? {Authorization: `Bearer ${key}`} : {}});
      if (r.ok) {
        const body = await r.json();
        const got = (body && Array.isArray(body.data) ? body.data : [])
          .filter((m) => m && (m.kind === undefined || m.kind === "text"))  // speech models: the mic
          .filter((m) => typeof m.id === "string" && m.id);
        if (got.length) list = got;
      }
    } catch (e) { /* keep the fallback */ }
    models = new Map(list.map((m) => [m.id, m]));
    const keep = el.model.value;
    el.model.replaceChildren(...list.map((m) => new Option(m.id, m.id)));
    const dflt = list.find((m) => m.default === true);
    if (modelChosen && models.has(keep)) el.model.value = keep;
    else if (dflt) el.model.value = dflt.id;           // the model a request naming none gets
    else if (models.has(keep)) el.model.value = keep;
    updateMode();
    el.model.dataset.loaded = "1";
  }

  // where the chosen model's chat template comes from ("builtin", "tokenizer_config.json"...), or null
  function chatTemplate() {
    const m = models.get(el.model.value);
    const t = m && m.chat_template;
    return typeof t === "string" && t ? t : null;
  }

  function chatMode() {
    return chatTemplate() !== null && el.chat.checked;
  }

  // the form and the result follow the mode: a conversation (chat) or one raw completion
  function updateMode() {
    const template = chatTemplate();
    el.chat.disabled = template === null || cur !== null;  // no switching modes mid-reply
    el.chat.checked = template !== null && chatChosen !== false;
    el.chatTemplate.textContent = template === null ? "(this model has no chat template: raw completion)"
                                                    : `(template: ${template})`;
    const chat = chatMode();
    document.body.dataset.mode = chat ? "chat" : "raw";
    el.promptLabel.textContent = chat ? "Message" : "Prompt";
    el.generate.textContent = chat ? "Send" : "Generate";
    // the raw-completion example text is no question: clear it, unless it was edited
    if (chat && el.prompt.value === RAW_PLACEHOLDER) el.prompt.value = "";
    el.prompt.placeholder = chat ? CHAT_PLACEHOLDER : RAW_PLACEHOLDER;
    el.prompt.rows = chat ? 2 : 5;  // a message box, or room for a prompt to continue
    el.output.hidden = chat;
    el.conversation.hidden = !chat;
    el.newChat.hidden = !chat;
    el.historyNote.hidden = !chat || !el.historyNote.textContent;
  }

  // ---- display -------------------------------------------------------------------------
  function setStatus(state, text) {
    el.status.dataset.state = state;
    el.status.textContent = text;
  }

  function clearError(box = el.error) {
    box.hidden = true;
    box.replaceChildren();
  }

  function showError(e, box = el.error) {
    const head = document.createElement("div");
    head.className = "error-head";
    const code = document.createElement("span");
    code.className = "error-code";
    code.textContent = e.code || "error";
    head.append(code);
    if (e.status !== undefined && e.status !== null) {
      const status = document.createElement("span");
      status.className = "error-status";
      status.textContent = String(e.status);
      head.append(status);
    }
    const message = document.createElement("div");
    message.className = "error-message";
    message.textContent = e.message || "";
    const extra = [];
    if (e.param) extra.push(`param: ${e.param}`);
    if (typeof e.retry_after_ms === "number") extra.push(`retry after ${(e.retry_after_ms / 1000).toFixed(1)} s`);
    if (e.id) extra.push(`request: ${e.id}`);
    if (typeof e.utterance === "number") extra.push(`utterance ${e.utterance}`);
    const details = document.createElement("div");
    details.className = "error-details";
    details.textContent = extra.join(" · ");
    box.replaceChildren(head, message, ...(extra.length ? [details] : []));
    box.hidden = false;
  }

  function fmtMs(ms) {
    return ms < 10 ? `${ms.toFixed(1)} ms` : `${Math.round(ms)} ms`;
  }

  function rate(c) {
    // decode rate: tokens after the first, over the time since the first
    if (!c || c.n < 2 || c.tLast <= c.tFirst) return null;
    return (c.n - 1) / ((c.tLast - c.tFirst) / 1000);
  }

  function render() {
    renderQueued = false;
    if (!cur) return;
    el.count.textContent = String(cur.n);
    const r = rate(cur);
    el.tps.textContent = r === null ? "–" : r.toFixed(1);
  }

  function queueRender() {
    if (!renderQueued) {
      renderQueued = true;
      requestAnimationFrame(render);
    }
  }

  function resetResult() {
    clearError();
    el.output.textContent = "";
    el.output.append(document.createTextNode(""));
    el.usage.textContent = "";
    el.ttft.textContent = "–";
    el.tps.textContent = "–";
    el.count.textContent = "0";
    el.queue.textContent = "–";
  }

  function setBusy(busy) {
    el.generate.disabled = busy;
    el.stop.disabled = !busy;
    el.newChat.disabled = busy;
    el.chat.disabled = busy || chatTemplate() === null;  // no switching modes mid-reply
    el.model.disabled = busy;                             // (nor models: the reply names its model)
  }

  // ---- the conversation -------------------------------------------------------------------
  function scrolledToBottom(box) {
    return box.scrollHeight - box.scrollTop - box.clientHeight < 24;
  }

  function addTurn(role, content) {
    const node = document.createElement("div");
    node.className = "turn";
    node.dataset.role = role;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = role === "user" ? "You" : el.model.value;
    const text = document.createElement("div");
    text.className = "text";
    text.append(document.createTextNode(content));
    const meta = document.createElement("div");
    meta.className = "meta";
    node.append(who, text, meta);
    const box = el.conversation;
    const atBottom = scrolledToBottom(box);
    box.querySelector(".empty-note")?.remove();
    box.append(node);
    if (atBottom || role === "user") box.scrollTop = box.scrollHeight;
    return {role, content, node};
  }

  function setTurnMeta(turn, state, text) {
    turn.node.dataset.state = state;
    turn.node.querySelector(".meta").textContent = text;
  }

  // the turns a message is sent with: the newest (the user's message) always, then whole
  // exchanges back from it while their characters fit the history limit; the older ones are
  // marked "not sent" (and stay out: the limit counts from the newest)
  function historyLimit() {
    const v = Number(el.historyChars.value);
    return Number.isFinite(v) && v >= 1 ? Math.floor(v) : HISTORY_CHARS_DEFAULT;
  }

  function turnsToSend() {
    const limit = historyLimit();
    const last = turns.length - 1;
    let first = last;
    let chars = turns[last].content.length;
    // earlier turns go in pairs (a question and its reply), so the history never starts with a reply
    while (first >= 2) {
      const pair = turns[first - 2].content.length + turns[first - 1].content.length;
      if (chars + pair > limit) break;
      chars += pair;
      first -= 2;
    }
    turns.forEach((t, k) => t.node.classList.toggle("dropped", k < first));
    if (first > 0) {
      el.historyNote.textContent = `${first} older turn${first === 1 ? "" : "s"} not sent: the conversation is past ` +
        `the history limit of ${limit.toLocaleString("en")} characters (Advanced). ` +
        `This message went with the last ${last - first + 1} turn${last === first ? "" : "s"} (${chars.toLocaleString("en")} characters).`;
      el.historyNote.hidden = false;
    } else {
      el.historyNote.textContent = "";
      el.historyNote.hidden = true;
    }
    return turns.slice(first).map((t) => ({role: t.role, content: t.content}));
  }

  function newConversation() {
    if (cur) return;
    turns = [];
    emptyNote("New conversation: ask something. Each message is sent with the turns before it.");
    el.historyNote.textContent = "";
    el.historyNote.hidden = true;
    resetResult();
    setStatus("idle", "idle");
    el.prompt.focus();
  }

  // a chat request ended: its reply joins the conversation as it was shown (cut short by
  // Stop or a dropped connection too); a request that failed before any text leaves no
  // turns, and its message goes back into the box to be sent again
  function endChat(c, state, statusText) {
    const reply = c.reply;
    if (state === "error" && c.text === "") {
      reply.node.remove();
      c.user.node.remove();
      turns = turns.filter((t) => t !== c.user);
      if (!el.prompt.value) el.prompt.value = c.user.content;
      if (!turns.length) emptyNote("No messages yet: ask something. Each message is sent with the turns before it.");
      return;
    }
    reply.content = c.text;
    turns.push(reply);
    const tokens = `${c.n} token${c.n === 1 ? "" : "s"}`;
    if (state === "cancelled") {
      setTurnMeta(reply, "cancelled", c.text ? `stopped after ${tokens}: kept as shown` : "stopped before any text");
    } else if (state === "error") {
      setTurnMeta(reply, "error", `interrupted after ${tokens}: kept as shown`);
    } else {
      setTurnMeta(reply, "done", `${statusText} · ${tokens}`);
    }
  }

  function emptyNote(text) {
    const note = document.createElement("p");
    note.className = "empty-note";
    note.textContent = text;
    el.conversation.replaceChildren(note);
  }

  // ---- requests ------------------------------------------------------------------------
  function numberField(input, parse) {
    const raw = input.value.trim();
    if (raw === "") return undefined;
    const v = parse(raw);
    return Number.isFinite(v) ? v : raw;  // let the gateway name a bad value
  }

  function generate() {
    if (cur) return;
    resetResult();
    const chat = chatMode();
    if (chat && !el.prompt.value.trim()) {
      showError({code: "empty_message", message: "type a message first"});
      el.prompt.focus();
      return;
    }
    const id = `r${++seq}`;
    const frame = {type: "generate", id, model: el.model.value, priority: el.priority.value};
    let user = null;
    if (chat) {
      user = addTurn("user", el.prompt.value);
      turns.push(user);
      frame.messages = turnsToSend();
      el.prompt.value = "";
    } else {
      frame.prompt = el.prompt.value;
    }
    const maxTokens = numberField(el.maxTokens, Number);
    if (maxTokens !== undefined) frame.max_tokens = maxTokens;
    const temperature = numberField(el.temperature, Number);
    if (temperature !== undefined) frame.temperature = temperature;
    const seed = numberField(el.seed, Number);
    if (seed !== undefined) frame.seed = seed;
    if (el.ignoreEos.checked) frame.ignore_eos = true;

    cur = {id, t0: 0, tFirst: 0, tLast: 0, n: 0, stopping: false, queuedOnly: true, chat};
    if (chat) {
      cur.user = user;
      cur.text = "";
      cur.reply = addTurn("assistant", "");
      setTurnMeta(cur.reply, "streaming", "");
    }
    const mine = cur;
    setBusy(true);
    setStatus("streaming", "streaming");
    send(frame, () => { mine.t0 = performance.now(); mine.queuedOnly = false; });
  }

  function stop() {
    if (!cur || cur.stopping) return;
    cur.stopping = true;
    el.stop.disabled = true;
    if (cur.queuedOnly) {  // never left the page: drop it
      pending = pending.filter((p) => p.frame.id !== cur.id);
      finish("cancelled");
      return;
    }
    setStatus("stopping", "stopping…");
    send({type: "cancel", id: cur.id});
  }

  function finish(state, text) {
    if (!cur) return;
    render();
    const c = cur;
    finished.add(c.id);
    cur = null;
    if (c.chat) endChat(c, state, text || state);
    setStatus(state, text || state);
    setBusy(false);
  }

  function onFrame(msg) {
    const mine = cur && msg.id === cur.id;
    switch (msg.type) {
      case "accepted":
        if (mine) el.queue.textContent = String(msg.queue_depth ?? "–");
        break;
      case "token":
        if (!mine) break;
        {
          const now = performance.now();
          if (cur.n === 0) {
            cur.tFirst = now;
            el.ttft.textContent = fmtMs(now - cur.t0);
          }
          cur.n += 1;
          cur.tLast = now;
          if (msg.text) {
            const o = cur.chat ? el.conversation : el.output;
            const atBottom = scrolledToBottom(o);
            if (cur.chat) {
              cur.text += msg.text;
              cur.reply.node.querySelector(".text").firstChild.appendData(msg.text);
            } else {
              o.lastChild.appendData(msg.text);
            }
            if (atBottom) o.scrollTop = o.scrollHeight;
          }
          queueRender();
        }
        break;
      case "done":
        if (!mine) break;
        {
          const u = msg.usage || {};
          const t = msg.timing || {};
          const parts = [`finish_reason: ${msg.finish_reason}`];
          if (u.prompt_tokens !== undefined) parts.push(`prompt ${u.prompt_tokens} tokens`);
          if (u.completion_tokens !== undefined) parts.push(`completion ${u.completion_tokens} tokens`);
          if (t.ttft_ms !== undefined) parts.push(`server ttft ${fmtMs(t.ttft_ms)}`);
          if (t.total_ms !== undefined) parts.push(`total ${fmtMs(t.total_ms)}`);
          el.usage.textContent = parts.join(" · ");
          const reason = msg.finish_reason || "unknown";
          if (reason === "cancelled") finish("cancelled", "cancelled");
          else finish("done", `done: ${reason}`);
        }
        break;
      case "error":
        if (msg.id && !mine && finished.has(msg.id) && msg.code === "unknown_id") break; // a cancel that lost the race
        showError(msg);
        if (mine && cur.chat && msg.code === "prompt_too_long") {
          const hint = document.createElement("div");
          hint.className = "error-hint";
          hint.textContent = "The conversation is too long for the model: start a new conversation, " +
                             "or lower the chat history limit (Advanced).";
          el.error.append(hint);
        }
        if (mine || (!msg.id && cur)) finish("error", "error");
        break;
      default:
        break; // pong and frames this page does not know
    }
  }

  // ---- voice ---------------------------------------------------------------------------
  const VOICE_MODEL = "asr-en";  // the fleet's speech model (the gateway's default_asr_model)
  const VOICE_RATE = 16000;      // what the worklet sends: 16 kHz mono PCM16LE...
  const VOICE_CHUNK_MS = 20;     // ...in 20 ms frames (the gateway takes 10-100 ms, at most 150 a second)

  // the microphone session: {ctx, stream, ws, queue, started, stopping}; null when the mic is off
  let voice = null;

  function setVoiceStatus(state, text) {
    el.voiceStatus.dataset.state = state;
    el.voiceStatus.textContent = text || state;
  }

  function setMicButton(on) {
    el.mic.textContent = on ? "Stop" : "Mic";
    el.mic.setAttribute("aria-pressed", String(on));
    el.mic.disabled = false;
  }

  // the voice box shows errors, and the gateway's warnings (high_load) in its warning style
  function showVoiceError(e, warning = false) {
    // e.id is the voice session's id ("audio"), not a request's: leave it out
    showError({...e, id: undefined}, el.voiceError);
    el.voiceError.classList.toggle("warning", warning);
    el.voiceError.dataset.utterance = typeof e.utterance === "number" ? String(e.utterance) : "";
  }

  // what went wrong opening the microphone (getUserMedia, the AudioContext or the worklet)
  function micError(e) {
    const messages = {
      NotAllowedError: "the browser refused the microphone: allow it for this site and try again",
      NotFoundError: "no microphone found",
      NotReadableError: "the microphone could not be opened (in use by another application?)",
    };
    return {code: "microphone_unavailable",
            message: messages[e && e.name] || `the microphone could not be started (${e})`};
  }

  async function startVoice() {
    clearError(el.voiceError);
    el.partial.textContent = "";
    el.finals.replaceChildren();  // utterances count from 0 again on a new connection
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia || !window.AudioWorkletNode) {
      showVoiceError({code: "microphone_unavailable", message: window.isSecureContext
        ? "this browser cannot record audio here (no getUserMedia or AudioWorklet)"
        : "the microphone needs a secure page: open it over https, or on localhost"});
      setVoiceStatus("error");
      return;
    }
    const v = {ctx: null, stream: null, ws: null, queue: [], started: false, stopping: false};
    voice = v;
    el.mic.disabled = true;  // while the browser asks for the microphone
    try {
      v.ctx = new AudioContext();  // before the first await: still in the click, so autoplay lets it run
      const [stream] = await Promise.all([
        // the browser's voice processing off: the page plays no sound to cancel, and echo
        // cancellation, noise suppression and gain control distort speech enough to cost
        // the recogniser words ("fair enough" for "turn off" in the page's test), which
        // normalises each utterance's level itself
        navigator.mediaDevices.getUserMedia({audio: {channelCount: 1, echoCancellation: false,
                                                     noiseSuppression: false, autoGainControl: false}}),
        v.ctx.audioWorklet.addModule("static/mic-worklet.js"),
      ]);
      v.stream = stream;
      const node = new AudioWorkletNode(v.ctx, "pcm16-downsampler", {
        numberOfInputs: 1, numberOfOutputs: 0, channelCount: 1, channelCountMode: "explicit",
        channelInterpretation: "speakers", processorOptions: {targetRate: VOICE_RATE, chunkMs: VOICE_CHUNK_MS}});
      node.port.onmessage = (ev) => sendAudio(v, ev.data);
      v.ctx.createMediaStreamSource(stream).connect(node);
      await v.ctx.resume();
    } catch (e) {
      showVoiceError(micError(e));
      endVoice(v, "error");
      return;
    }
    openVoiceSocket(v);
    setMicButton(true);
    setVoiceStatus("listening");
  }

  function openVoiceSocket(v) {
    const ws = new WebSocket(socketUrl("/v1/audio/stream"));
    v.ws = ws;
    ws.onopen = () => ws.send(JSON.stringify({type: "start", model: VOICE_MODEL, sample_rate: VOICE_RATE,
                                              encoding: "pcm_s16le"}));
    ws.onmessage = (ev) => {
      if (voice !== v || typeof ev.data !== "string") return;
      let msg;
      try { msg = JSON.parse(ev.data); } catch (e) { return; }
      onVoiceFrame(v, msg);
    };
    ws.onclose = (ev) => {
      if (voice !== v) return;
      showVoiceError({code: "connection_closed", status: ev.code,
                      message: `the voice WebSocket closed${ev.reason ? " (" + ev.reason + ")" : ""}`});
      endVoice(v, "error");
    };
  }

  function sendAudio(v, pcm) {
    if (v.stopping || voice !== v) return;  // chunks still on their way from the worklet after Stop
    if (v.started) v.ws.send(pcm);
    else v.queue.push(pcm);                 // audio goes out only once the gateway said "started"
  }

  function stopVoice() {
    const v = voice;
    if (!v || v.stopping) return;
    v.stopping = true;
    if (!v.started) {  // the gateway has no session to end
      endVoice(v, "idle");
      return;
    }
    // (the worklet's last, unfinished chunk, under 20 ms, is not sent)
    v.ws.send(JSON.stringify({type: "stop"}));
    releaseMic(v);
    el.mic.disabled = true;
    setVoiceStatus("stopping", "stopping…");  // the gateway answers "stopped" after the last final
  }

  function releaseMic(v) {
    if (v.stream) v.stream.getTracks().forEach((t) => t.stop());
    if (v.ctx) v.ctx.close().catch(() => {});
    v.stream = null;
    v.ctx = null;
  }

  function endVoice(v, state) {
    releaseMic(v);
    if (v.ws) {
      v.ws.onclose = null;
      v.ws.close(1000, "done");
    }
    if (voice === v) voice = null;
    setMicButton(false);
    setVoiceStatus(state);
  }

  function showFinal(utterance, text) {
    const li = document.createElement("li");
    li.dataset.utterance = String(utterance);
    li.textContent = text;
    li.classList.toggle("empty", !text);
    // in utterance order, whatever order the finals come in
    const after = [...el.finals.children].find((x) => Number(x.dataset.utterance) > utterance);
    el.finals.insertBefore(li, after || null);
    if (el.partial.dataset.utterance === String(utterance)) el.partial.textContent = "";
    if (el.voiceError.classList.contains("warning") && el.voiceError.dataset.utterance === String(utterance)) {
      clearError(el.voiceError);  // its high_load warning is over
    }
  }

  function onVoiceFrame(v, msg) {
    switch (msg.type) {
      case "started":
        v.started = true;
        for (const pcm of v.queue) v.ws.send(pcm);
        v.queue = [];
        break;
      case "speech_started":
        if (!v.stopping) setVoiceStatus("speaking");
        break;
      case "speech_stopped":
        if (!v.stopping) setVoiceStatus("listening");
        break;
      case "partial":  // the utterance's whole hypothesis so far
        el.partial.dataset.utterance = String(msg.utterance);
        el.partial.textContent = msg.text || "";
        break;
      case "final":
        showFinal(msg.utterance, msg.text || "");
        break;
      case "warning":
        showVoiceError(msg, true);
        break;
      case "error":  // with an utterance: that utterance failed and gets no final
        showVoiceError(msg);
        if (el.partial.dataset.utterance === String(msg.utterance)) el.partial.textContent = "";
        if (!v.started) endVoice(v, "error");  // the start was refused; otherwise the session goes on
        break;
      case "stopped":
        endVoice(v, "idle");
        break;
      default:
        break; // pong and frames this page does not know
    }
  }

  // ---- wiring --------------------------------------------------------------------------
  el.form.addEventListener("submit", (ev) => { ev.preventDefault(); generate(); });
  el.stop.addEventListener("click", stop);
  el.newChat.addEventListener("click", newConversation);
  el.prompt.addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter" || ev.isComposing) return;
    // Ctrl/Cmd+Enter sends in both modes; in chat a plain Enter sends too (Shift+Enter: a new line)
    // (through the form, so its fields' own checks apply as for the button)
    if (ev.ctrlKey || ev.metaKey || (chatMode() && !ev.shiftKey && !ev.altKey)) { ev.preventDefault(); el.form.requestSubmit(); }
  });
  el.model.addEventListener("change", () => { modelChosen = true; updateMode(); });
  el.chat.addEventListener("change", () => { chatChosen = el.chat.checked; updateMode(); });
  el.apiKey.addEventListener("change", () => { reconnectNow(); loadModels(); });
  el.mic.addEventListener("click", () => { if (voice) stopVoice(); else startVoice(); });

  updateMode();
  loadModels();
  connect();
})();

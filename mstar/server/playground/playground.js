// The mstar playground: talk to the served model through its OpenAI-style routes, and see each
// answer's walk trace (GET /v1/requests/{id}/trace) drawn as a timeline per rank and node.
// No build step, no dependencies: plain DOM and fetch.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, routes: [], chat: [] };
const TABS = [
  ["chat", "Chat", "/v1/chat/completions"],
  ["speech", "Speech", "/v1/audio/speech"],
  ["image", "Image", "/v1/images/generations"],
];

function headers(json = true) {
  const h = {};
  if (json) h["content-type"] = "application/json";
  const key = $("api-key").value.trim();
  if (key) h["authorization"] = "Bearer " + key;
  return h;
}

function newId() {
  return "pg-" + Math.random().toString(36).slice(2, 12);
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// A turn: the user's message, the answer beside its trace.
function addTurn(log, userText) {
  const turn = el("div", "turn");
  const left = el("div");
  left.append(el("div", "msg user", userText));
  const answer = el("div", "msg assistant");
  left.append(answer);
  const trace = el("div", "trace");
  turn.append(left, trace);
  log.append(turn);
  log.scrollTop = log.scrollHeight;
  return { answer, trace };
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

function showError(node, message) {
  node.className = "msg error";
  node.textContent = message;
}

// -- the trace timeline --------------------------------------------------------------------------

async function showTrace(box, id) {
  box.textContent = "";
  const r = await fetch(`/v1/requests/${encodeURIComponent(id)}/trace`, { headers: headers(false) });
  if (!r.ok) {
    box.append(el("div", "caption", `trace: ${await errorText(r)}`));
    return;
  }
  const doc = await r.json();
  for (const t of doc.requests) box.append(timeline(t));
}

function timeline(t) {
  const wrap = el("div");
  const runs = t.walks.flatMap((w) => w.nodes.map((n) => ({ ...n, walk: w.walk })));
  const t0 = t.submitted;
  const end = Math.max(t.ended || 0, ...t.walks.map((w) => w.end || w.start),
                       ...runs.map((n) => n.start + n.compute_ms / 1e3)) - t0;
  const total = Math.max(end * 1e3, 1);
  const rows = [...new Set(runs.map((n) => `rank ${n.rank} · ${n.node}`))].sort();
  const busy = runs.reduce((s, n) => s + n.compute_ms, 0);
  wrap.append(el("div", "caption",
    `${t.request_id}: ${t.status}${t.finish_reason ? " (" + t.finish_reason + ")" : ""}, ` +
    `${total.toFixed(1)} ms, ${t.walks.length} walk(s), ${runs.length} node run(s), ${busy.toFixed(1)} ms in forwards`));
  const W = 640, left = 150, rowH = 16, top = 28;
  const H = top + rows.length * rowH + 24;
  const x = (ms) => left + (W - left - 10) * Math.max(0, ms) / total;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("class", "trace-timeline");
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
    return e;
  };
  t.walks.forEach((w, i) => {  // the walks: bands behind the runs
    const a = x((w.start - t0) * 1e3), b = x(((w.end || w.start) - t0) * 1e3);
    add("rect", { x: a, y: top - 4, width: Math.max(b - a, 1), height: H - top - 16,
                  fill: i % 2 ? "#eef1f6" : "#e4e9f2" });
    add("text", { x: a + 2, y: i % 2 ? 21 : 11, "font-size": 10, fill: "#445" }, w.walk);  // staggered: short walks
  });
  rows.forEach((name, i) => add("text", { x: 4, y: top + i * rowH + 11, "font-size": 10 }, name));
  for (const n of runs) {
    const i = rows.indexOf(`rank ${n.rank} · ${n.node}`);
    const a = x((n.start - t0) * 1e3);
    const bar = add("rect", { x: a, y: top + i * rowH + 2, width: Math.max(x((n.start - t0) * 1e3 + n.compute_ms) - a, 1),
                              height: rowH - 5, fill: "#3b6fc4" });
    const tip = document.createElementNS(ns, "title");
    tip.textContent = `${n.node} (${n.walk}) iteration [${n.iteration}] batch ${n.batch}: ` +
                      `${n.compute_ms.toFixed(2)} ms, queued ${n.queued_ms.toFixed(2)} ms`;
    bar.append(tip);
  }
  add("text", { x: left, y: H - 4, "font-size": 10, fill: "#667" }, "0 ms");
  add("text", { x: W - 10, y: H - 4, "font-size": 10, fill: "#667", "text-anchor": "end" }, `${total.toFixed(1)} ms`);
  wrap.append(svg);
  return wrap;
}

// -- chat ----------------------------------------------------------------------------------------

function fileAsBase64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function sendChat(event) {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  const file = $("chat-file").files[0];
  if (!text && !file) return;
  let content = text;
  if (file) {
    const url = await fileAsBase64(file);
    const part = file.type.startsWith("image/")
      ? { type: "image_url", image_url: { url } }
      : { type: "input_audio", input_audio: { data: url.split(",")[1], format: "wav" } };
    content = [part, ...(text ? [{ type: "text", text }] : [])];
  }
  $("chat-input").value = "";
  $("chat-file").value = "";
  const { answer, trace } = addTurn($("chat-log"), text || `(${file.name})`);
  const id = newId();
  const spoken = $("chat-speak").checked;
  const body = { model: state.model, messages: [...state.chat, { role: "user", content }],
                 max_tokens: Number($("chat-max").value) || 64, stream: true };
  if (spoken) Object.assign(body, { modalities: ["text", "audio"], audio: { voice: $("speech-voice").value, format: "pcm16" } });
  const r = await fetch("/v1/chat/completions", { method: "POST", headers: { ...headers(), "x-request-id": id },
                                                  body: JSON.stringify(body) });
  if (!r.ok) {
    showError(answer, await errorText(r));
    await showTrace(trace, id).catch(() => {});
    return;
  }
  const player = spoken ? new PcmPlayer() : null;
  let reply = "";
  for await (const data of sseEvents(r)) {
    if (data.error) { showError(answer, data.error.message); break; }
    const delta = (data.choices && data.choices[0] && data.choices[0].delta) || {};
    if (delta.content) { reply += delta.content; answer.textContent = reply; }
    if (delta.audio && delta.audio.data && player) player.play(delta.audio.data);
  }
  state.chat.push({ role: "user", content }, { role: "assistant", content: reply });
  await showTrace(trace, id);
}

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const payload = line.slice(6);
        if (payload === "[DONE]") return;
        yield JSON.parse(payload);
      }
    }
  }
}

// -- audio ---------------------------------------------------------------------------------------

// PCM16 (24 kHz mono) chunks played back to back as they arrive.
class PcmPlayer {
  constructor(rate = 24000) {
    this.ctx = new (window.AudioContext || window.webkitAudioContext)({ sampleRate: rate });
    this.rate = rate;
    this.at = 0;
    this.rest = new Uint8Array(0);
  }
  play(chunk) {  // base64 string or Uint8Array of little-endian int16 samples
    let bytes = typeof chunk === "string" ? Uint8Array.from(atob(chunk), (c) => c.charCodeAt(0)) : chunk;
    if (this.rest.length) { const joined = new Uint8Array(this.rest.length + bytes.length); joined.set(this.rest); joined.set(bytes, this.rest.length); bytes = joined; }
    const n = bytes.length >> 1;
    this.rest = bytes.slice(2 * n);
    if (!n) return;
    const view = new DataView(bytes.buffer, bytes.byteOffset, 2 * n);
    const buffer = this.ctx.createBuffer(1, n, this.rate);
    const out = buffer.getChannelData(0);
    for (let i = 0; i < n; i++) out[i] = view.getInt16(2 * i, true) / 32768;
    const src = this.ctx.createBufferSource();
    src.buffer = buffer;
    src.connect(this.ctx.destination);
    this.at = Math.max(this.at, this.ctx.currentTime + 0.05);
    src.start(this.at);
    this.at += n / this.rate;
  }
}

async function sendSpeech(event) {
  event.preventDefault();
  const text = $("speech-input").value.trim();
  if (!text) return;
  const { answer, trace } = addTurn($("speech-log"), text);
  const id = newId();
  const r = await fetch("/v1/audio/speech", {
    method: "POST", headers: { ...headers(), "x-request-id": id },
    body: JSON.stringify({ model: state.model, input: text, voice: $("speech-voice").value,
                           response_format: "pcm", stream_format: "audio" }) });
  if (!r.ok) {
    showError(answer, await errorText(r));
    await showTrace(trace, id).catch(() => {});
    return;
  }
  const player = new PcmPlayer();
  const reader = r.body.getReader();
  let bytes = 0;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    bytes += value.length;
    player.play(value);
    answer.textContent = `playing: ${(bytes / 48000).toFixed(2)} s of audio`;
  }
  answer.textContent = `${(bytes / 48000).toFixed(2)} s of audio (24 kHz), played as it streamed`;
  await showTrace(trace, id);
}

// -- images --------------------------------------------------------------------------------------

async function sendImage(event) {
  event.preventDefault();
  const prompt = $("image-input").value.trim();
  if (!prompt) return;
  const file = $("image-file").files[0];
  const { answer, trace } = addTurn($("image-log"), prompt + (file ? ` (editing ${file.name})` : ""));
  answer.textContent = "drawing…";
  const id = newId();
  let r;
  if (file) {
    const form = new FormData();
    form.append("model", state.model);
    form.append("prompt", prompt);
    form.append("image", file);
    form.append("response_format", "b64_json");
    r = await fetch("/v1/images/edits", { method: "POST", headers: { ...headers(false), "x-request-id": id }, body: form });
  } else {
    r = await fetch("/v1/images/generations", {
      method: "POST", headers: { ...headers(), "x-request-id": id },
      body: JSON.stringify({ model: state.model, prompt, size: $("image-size").value, response_format: "b64_json" }) });
  }
  if (!r.ok) {
    showError(answer, await errorText(r));
    await showTrace(trace, id).catch(() => {});
    return;
  }
  const body = await r.json();
  answer.textContent = "";
  const img = el("img");
  img.src = "data:image/png;base64," + body.data[0].b64_json;
  img.alt = prompt;
  answer.append(img);
  await showTrace(trace, id);
}

// -- start ---------------------------------------------------------------------------------------

function showTab(name) {
  for (const [id] of TABS) {
    $(id).hidden = id !== name;
    const b = document.querySelector(`nav button[data-tab="${id}"]`);
    if (b) b.classList.toggle("on", id === name);
  }
}

async function connect() {
  const r = await fetch("/v1/models", { headers: headers(false) });
  if (!r.ok) {
    $("model").textContent = `cannot list the models: ${await errorText(r)}`;
    return;
  }
  const card = (await r.json()).data[0];
  state.model = card.id;
  state.routes = card.routes || [];
  $("model").textContent = `${card.id} · ${state.routes.join(", ")}`;
  const nav = $("tabs");
  nav.textContent = "";
  const offered = TABS.filter(([, , path]) => state.routes.includes(path));
  for (const [id, label] of offered) {
    const b = el("button", "", label);
    b.type = "button";
    b.dataset.tab = id;
    b.onclick = () => showTab(id);
    nav.append(b);
  }
  if (state.routes.includes("/v1/audio/speech")) {
    const v = await fetch("/v1/audio/voices", { headers: headers(false) });
    const voices = v.ok ? ((await v.json()).voices || []) : [];
    $("speech-voice").textContent = "";
    for (const voice of voices) $("speech-voice").append(new Option(voice.name || voice.id || voice, voice.id || voice));
    $("chat-speak-label").hidden = !(voices.length && state.routes.includes("/v1/chat/completions"));
  }
  if (offered.length) showTab(offered[0][0]);
  else $("model").textContent += " (no route this page can use)";
}

$("chat-form").addEventListener("submit", (e) => sendChat(e).catch((err) => console.error(err)));
$("speech-form").addEventListener("submit", (e) => sendSpeech(e).catch((err) => console.error(err)));
$("image-form").addEventListener("submit", (e) => sendImage(e).catch((err) => console.error(err)));
$("api-key").addEventListener("change", () => { localStorage.setItem("mstar-api-key", $("api-key").value); connect(); });
$("api-key").value = localStorage.getItem("mstar-api-key") || "";
connect();

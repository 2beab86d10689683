// The chat page: conversation state, sending, streaming answers in, Stop, errors.
import { renderMarkdown } from "./markdown.js";
import { Attachments } from "./attachments.js";
import { StatusMonitor } from "./status.js";
import { readSSE } from "./sse.js";

const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop"), form: $("composer"),
  error: $("error"), system: $("system-prompt"), temperature: $("temperature"), maxTokens: $("max-tokens"),
};
// history holds what the model sees: OpenAI messages, user content with image_url parts when images are attached.
const chat = { history: [], controller: null, model: null };

const attachments = new Attachments({
  container: $("attachments"), fileInput: $("file-input"), button: $("attach"), note: $("image-note"),
  onError: showError,
});
const status = new StatusMonitor({
  onModel: (id) => { chat.model = id; },
  onCapabilities: ({ multimodal }) => {
    if (multimodal !== attachments.enabled) {
      attachments.setEnabled(multimodal, "Image upload is off: the model being served is text-only.");
    }
  },
});

// ---- errors -----------------------------------------------------------------------------------------------
function showError(message) {
  ui.error.querySelector(".error-text").textContent = message;
  ui.error.hidden = false;
}
function hideError() { ui.error.hidden = true; }
ui.error.querySelector(".dismiss").addEventListener("click", hideError);

async function httpErrorMessage(resp) {
  let message = "";
  try {
    const body = await resp.json();
    message = body?.error?.message || (typeof body?.detail === "string" ? body.detail : "");
  } catch { /* not JSON: fall back to the status line */ }
  return `Error ${resp.status}: ${message || resp.statusText || "request failed"}`;
}

// ---- message elements ---------------------------------------------------------------------------------------
function nearBottom() {
  return ui.messages.scrollHeight - ui.messages.scrollTop - ui.messages.clientHeight < 80;
}
function scrollToEnd() { ui.messages.scrollTop = ui.messages.scrollHeight; }

function addMessage(role) {
  $("empty-state")?.remove();
  const box = document.createElement("article");
  box.className = `msg ${role}`;
  box.setAttribute("aria-label", role === "user" ? "You" : "Assistant");
  const content = document.createElement("div");
  content.className = "content";
  box.append(content);
  ui.messages.append(box);
  scrollToEnd();
  return box;
}

function addUserMessage(text, images) {
  const box = addMessage("user");
  const content = box.querySelector(".content");
  if (images.length) {
    const row = document.createElement("div");
    row.className = "msg-images";
    for (const image of images) {
      const img = document.createElement("img");
      img.src = image.url;
      img.alt = image.name;
      row.append(img);
    }
    content.append(row);
  }
  if (text) {
    const p = document.createElement("p");
    p.textContent = text;  // the user's own words, shown exactly as typed
    content.append(p);
  }
  return box;
}

function speedText(m) {
  const parts = [];
  if (m.ttft !== null) parts.push(`${(m.ttft / 1000).toFixed(2)} s to first token`);
  if (m.rate !== null) parts.push(`${m.rate.toFixed(1)} tok/s`);
  parts.push(`${m.tokens} token${m.tokens === 1 ? "" : "s"}`);
  return parts.join(" · ");
}

// ---- sending --------------------------------------------------------------------------------------------------
function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.hidden = !busy;
  ui.messages.setAttribute("aria-busy", String(busy));
  status.setBusy(busy);
}

function requestBody() {
  const messages = [];
  const system = ui.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.history);
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (chat.model) body.model = chat.model;
  const temperature = parseFloat(ui.temperature.value);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const maxTokens = parseInt(ui.maxTokens.value, 10);
  if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

async function send() {
  if (chat.controller) return;
  const text = ui.prompt.value.trim();
  const images = attachments.list();
  if (!text && !images.length) return;
  hideError();

  const content = images.length
    ? [...images.map((i) => ({ type: "image_url", image_url: { url: i.url } })), ...(text ? [{ type: "text", text }] : [])]
    : text;
  const history = chat.history;  // "New chat" during the stream swaps in a fresh array; this turn stays in its own
  history.push({ role: "user", content });
  const userBox = addUserMessage(text, images);
  const box = addMessage("assistant");
  box.classList.add("streaming");
  box.dataset.status = "streaming";
  const contentEl = box.querySelector(".content");
  ui.prompt.value = "";
  autoresize();
  attachments.clear();

  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let answer = "", chunks = 0, tFirst = null, tLast = null, usage = null, finish = null, sawDone = false;
  let outcome = "done", frame = 0;
  const render = () => {
    frame = 0;
    const stick = nearBottom();
    contentEl.replaceChildren(renderMarkdown(answer));
    if (stick) scrollToEnd();
  };

  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await httpErrorMessage(resp));
    for await (const data of readSSE(resp.body)) {
      if (data === "[DONE]") { sawDone = true; break; }
      let event;
      try { event = JSON.parse(data); } catch { continue; }
      if (event.error) throw new Error(`The engine reported an error: ${event.error.message || "unknown error"}`);
      if (event.usage) usage = event.usage;
      const choice = event.choices?.[0];
      const delta = choice?.delta?.content;
      if (delta) {
        const now = performance.now();
        if (tFirst === null) tFirst = now;
        tLast = now;
        chunks += 1;
        answer += delta;
        box.dataset.chunks = String(chunks);
        if (!frame) frame = requestAnimationFrame(render);  // at most one re-render per frame
      }
      if (choice?.finish_reason) finish = choice.finish_reason;
    }
    if (!sawDone) throw new Error("The answer stream ended unexpectedly (the server closed the connection).");
  } catch (err) {
    if (err.name === "AbortError") {
      outcome = "stopped";
    } else {
      outcome = "error";
      showError(err instanceof TypeError
        ? "Network error: could not reach the chat server. Is the app still running?"
        : err.message);
    }
  } finally {
    if (frame) cancelAnimationFrame(frame);
    render();
    chat.controller = null;
    setBusy(false);
  }

  box.classList.remove("streaming");
  box.dataset.status = outcome;
  if (history !== chat.history) return;  // the conversation was cleared meanwhile
  if (!answer) {
    // Nothing came back: undo the turn and give the message back, so retrying is one keypress.
    history.pop();
    userBox.remove();
    box.remove();
    if (!ui.prompt.value) { ui.prompt.value = text; autoresize(); }
    if (!attachments.list().length) attachments.restore(images);
    ui.prompt.focus();
    return;
  }
  history.push({ role: "assistant", content: answer });
  const tokens = usage?.completion_tokens ?? chunks;
  const rate = tFirst !== null && tLast > tFirst && tokens > 1 ? (tokens - 1) / ((tLast - tFirst) / 1000) : null;
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.dataset.testid = "speed";
  meta.textContent = speedText({ ttft: tFirst === null ? null : tFirst - t0, rate, tokens });
  if (outcome === "stopped") meta.textContent += " · stopped";
  else if (outcome === "error") meta.textContent += " · incomplete";
  else if (finish === "length") meta.textContent += " · hit the max-tokens limit";
  box.dataset.ttftMs = tFirst === null ? "" : String(Math.round(tFirst - t0));
  box.dataset.tokens = String(tokens);
  box.append(meta);
  if (nearBottom()) scrollToEnd();
}

function stop() {
  // Aborting the fetch closes the connection; the proxy closes its upstream request and the engine stops.
  chat.controller?.abort();
}

// ---- composer -----------------------------------------------------------------------------------------------
function autoresize() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${Math.min(ui.prompt.scrollHeight, 240)}px`;
}

ui.form.addEventListener("submit", (e) => { e.preventDefault(); send(); });
ui.stop.addEventListener("click", stop);
ui.prompt.addEventListener("input", autoresize);
ui.prompt.addEventListener("keydown", (e) => {
  // isComposing: Enter that confirms an IME candidate (Chinese, Japanese…) must not send.
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
document.addEventListener("keydown", (e) => { if (e.key === "Escape" && chat.controller) stop(); });

ui.prompt.addEventListener("paste", (e) => {
  const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
  if (files.length) { e.preventDefault(); attachments.addFiles(files); }
});

// Drag and drop anywhere on the page; the overlay shows only while files are dragged over.
const overlay = $("drop-overlay");
let dragDepth = 0;
const hasFiles = (e) => [...(e.dataTransfer?.types || [])].includes("Files");
window.addEventListener("dragenter", (e) => { if (hasFiles(e)) { dragDepth += 1; overlay.hidden = false; } });
window.addEventListener("dragleave", (e) => { if (hasFiles(e) && --dragDepth <= 0) { dragDepth = 0; overlay.hidden = true; } });
window.addEventListener("dragover", (e) => { if (hasFiles(e)) e.preventDefault(); });
window.addEventListener("drop", (e) => {
  if (!hasFiles(e)) return;
  e.preventDefault();
  dragDepth = 0;
  overlay.hidden = true;
  attachments.addFiles([...e.dataTransfer.files]);
});

$("new-chat").addEventListener("click", () => {
  stop();
  chat.history = [];
  ui.messages.replaceChildren();
  hideError();
  ui.prompt.focus();
});

function showKV(open) {
  document.body.classList.toggle("kv-hidden", !open);
  $("toggle-kv").setAttribute("aria-expanded", String(open));
}
$("toggle-kv").addEventListener("click", () => showKV(document.body.classList.contains("kv-hidden")));
// On a phone the conversation needs the height: the KV panel starts folded away there.
if (window.matchMedia("(max-width: 900px)").matches) showKV(false);

// Settings survive a reload; the conversation deliberately does not (it may hold private images).
for (const input of [ui.system, ui.temperature, ui.maxTokens]) {
  const key = `localchat.${input.id}`;
  const saved = localStorage.getItem(key);
  if (saved !== null) input.value = saved;
  input.addEventListener("change", () => localStorage.setItem(key, input.value));
}

attachments.render();
status.start();
ui.prompt.focus();

// The chat page: saved chats, sending, streaming answers in, Stop, message actions, errors.
import { loadPageConfig } from "./api.js";
import { AnswerStream } from "./answer.js";
import { messageActions } from "./actions.js";
import { showReasoning } from "./reasoning.js";
import { Attachments } from "./attachments.js";
import { addChild, newChat, pathOf, removeNode } from "./conversation.js";
import { finishElement, messageElement } from "./messages.js";
import { handleCodeCopy, loadLibraries } from "./render.js";
import { Settings } from "./settings.js";
import { Sidebar } from "./sidebar.js";
import { DOWN_STATES, StatusMonitor } from "./status.js";
import { ChatStore, noteRemoved } from "./store.js";
import { Drafts } from "./drafts.js";
import { showContextMeter } from "./meter.js";
import { initShell } from "./shell.js";
import { KVMap } from "./kvmap.js";
import { ChatSettings } from "./chatsettings.js";
import { ChatSaving } from "./saving.js";
import { titleChat } from "./autotitle.js";
import { initScrollButton } from "./scrolldown.js";
import { chatRequest } from "./request.js";
import { askToFind, handleFind } from "./grounding.js";
import { videoLimits } from "./video_attach.js";

const $ = (id) => document.getElementById(id);
const ui = { messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop"), form: $("composer"),
             error: $("error"), sendNote: $("send-note"), meter: $("context-meter") };
// limits: what the server accepts (from /v1/models and /api/page-config); 8 images is the engine's default.
// abortReason: why the page itself gave up on the answer in flight (the engine went down meanwhile);
// refreshing: the read of this chat's stored copy in flight (ChatSaving.refresh).
const app = { store: new ChatStore(), drafts: null, chats: [], chat: newChat(), controller: null, model: null,
              abortReason: "", refreshing: null,
              limits: { maxImages: 8, maxBytes: 20 << 20, maxModelLen: null, multimodal: true, video: videoLimits(null) } };

const attachments = new Attachments({
  container: $("attachments"), fileInput: $("file-input"), button: $("attach"), note: $("image-note"),
  picker: $("pdf-picker"), onError: (m) => showError(m),
  onChange: () => { app.drafts.keep(); updateMeter(); },
});
app.drafts = new Drafts({ prompt: ui.prompt, attachments, resize: () => autoresize() });
const settings = new Settings({ onChange: () => chatSettings.capture() });
const chatSettings = new ChatSettings({ current: () => app.chat, save: (chat) => save(chat),
                                       validate: () => settings.validate() });
const saving = new ChatSaving({ app, render: () => renderConversation(), show: (chat) => chatSettings.show(chat),
                                open: (id) => openChat(id), showError: (m) => showError(m) });
const kvmap = new KVMap();
const status = new StatusMonitor({
  onModel: (card) => {
    app.model = card.id;
    app.limits.maxModelLen = card.max_model_len ?? null;
    if (Number.isInteger(card.max_images_per_prompt)) app.limits.maxImages = card.max_images_per_prompt;
    app.limits.video = videoLimits(card);
    Object.assign(attachments, { maxImages: app.limits.maxImages, video: app.limits.video });
    settings.showDefaults(card.sampling_defaults);
    clearTransientError();
    updateMeter();
  },
  onCapabilities: ({ multimodal }) => {
    const changed = app.limits.multimodal !== multimodal;
    app.limits.multimodal = multimodal;
    // The empty chat's hint names what the model reads; it may have been drawn before the model was known.
    const empty = document.getElementById("empty-state");
    if (changed && empty) empty.replaceWith(emptyState());
    document.body.classList.toggle("text-only", !multimodal);
    if (multimodal !== attachments.media) {
      attachments.setEnabled(multimodal, "Images, videos and PDFs are off: the model being served is text-only (text files still go).");
    }
  },
  onDown: () => { app.model = null; kvmap.clear(); updateMeter(); },
  onStats: () => kvmap.poll(),
  onState: (state) => {
    updateSendButton();
    // A request in flight to an engine that went away (or hangs) would wait forever: end it with the reason,
    // once two health answers in a row said so (one slow /health is not a hung engine).
    if (app.controller && DOWN_STATES.has(state) && status.downStreak >= 2) {
      app.abortReason = `The engine stopped answering while this answer was pending (${status.detail || state}).`;
      app.controller.abort();
    }
  },
});
// ---- errors -----------------------------------------------------------------------------------------------
// A transient error (the server or engine could not be reached) goes away by itself once the engine is back.
function showError(message, { transient = false } = {}) {
  ui.error.querySelector(".error-text").textContent = message;
  ui.error.hidden = false;
  ui.error.dataset.transient = String(transient);
}
function hideError() { ui.error.hidden = true; }
function clearTransientError() { if (ui.error.dataset.transient === "true") hideError(); }
ui.error.querySelector(".dismiss").addEventListener("click", hideError);

// ---- the conversation on screen -----------------------------------------------------------------------------
function nearBottom() { return ui.messages.scrollHeight - ui.messages.scrollTop - ui.messages.clientHeight < 80; }
function scrollToEnd() { ui.messages.scrollTop = ui.messages.scrollHeight; }

function emptyState() {
  const box = document.createElement("div");
  box.id = "empty-state";
  box.className = "empty";
  const title = document.createElement("p");
  title.className = "empty-title";
  title.textContent = "Ask anything.";
  const hint = document.createElement("p");
  hint.textContent = app.limits.multimodal
    ? "Attach images, videos, PDFs or text files with the button, by dragging them here, or by pasting. Enter sends; Shift+Enter adds a new line; Esc stops an answer."
    : "This model reads text only (text files can be attached). Enter sends; Shift+Enter adds a new line; Esc stops an answer.";
  box.append(title, hint);
  return box;
}

function renderConversation() {
  const path = pathOf(app.chat);
  ui.messages.replaceChildren(...(path.length ? path.map((n) => messageElement(app.chat, n)) : [emptyState()]));
  updateMeter();
  app.sidebar?.render();
  scrollToEnd();
}

function updateMeter() { showContextMeter(ui.meter, pathOf(app.chat), app.limits.maxModelLen, attachments.tokens()); }

// ---- saving (saving.js) ---------------------------------------------------------------------------------
function save(chat = app.chat) { return saving.save(chat); }

// Every removal goes through here, so that a later save (merged with the stored copy) does not bring it back.
function removeMessage(chat, id) {
  noteRemoved(chat, id);
  removeNode(chat, id);
}


function openChat(id, { replaceDraft = true } = {}) {
  if (app.controller) stop();
  // A new chat keeps the id it was opened with, so that its draft is found again after a reload.
  app.chat = app.chats.find((c) => c.id === id) || Object.assign(newChat(), id ? { id } : {});
  localStorage.setItem("localchat.chat", app.chat.id);
  chatSettings.show(app.chat);
  hideError();
  renderConversation();
  app.drafts.load(app.chat.id, { replace: replaceDraft });   // switching chats swaps the drafts
  if (matchMedia("(max-width: 900px)").matches) document.body.classList.remove("sidebar-open");   // a drawer there
}

function startNewChat() {
  openChat(null);
  ui.prompt.focus();
}

// ---- sending --------------------------------------------------------------------------------------------------
// Send is off while an answer streams, and while the engine cannot answer (loading, restarting, down).
function updateSendButton() {
  const reason = app.controller ? "" : status.reason();
  ui.send.disabled = Boolean(app.controller) || Boolean(reason);
  ui.send.title = reason;
}

function setBusy(busy) {
  updateSendButton();
  ui.stop.hidden = !busy;
  ui.messages.setAttribute("aria-busy", String(busy));
  status.setBusy(busy);
}

async function send() {
  await started;   // Enter works from the first paint; the chat list and the libraries arrive with start()
  if (app.controller) return;
  const text = ui.prompt.value.trim();
  const media = attachments.content();
  if (!text && !attachments.count()) return;
  const notNow = status.reason();
  if (notNow) { showError(notNow, { transient: true }); return; }
  hideError();
  if (app.refreshing) await app.refreshing;     // the turns another tab added come first
  const chat = app.chat;
  const path = pathOf(chat);
  const parentId = path.length ? path[path.length - 1].id : "root";
  const user = addChild(chat, parentId, { role: "user", text, ...media });
  ui.prompt.value = "";
  autoresize();
  attachments.clear();
  app.drafts.clear(chat.id);
  renderConversation();
  save(chat);           // the question is kept even if the page is closed while the answer streams
  const answered = await generate(chat, user);
  if (!answered && app.chat === chat) {
    // Nothing came back: undo the turn and give the message back, so retrying is one keypress.
    removeMessage(chat, user.id);
    renderConversation();
    if (!ui.prompt.value) { ui.prompt.value = text; autoresize(); }
    if (!attachments.count()) attachments.restore(media);
    app.drafts.keep();
    ui.prompt.focus();
  }
  await save(chat);
  // Not awaited: the chat goes on while the model thinks of a title.
  if (answered) titleChat(chat, { model: app.model, apply: (title, fallback) => saving.retitle(chat.id, title, fallback) });
}

// Streams a new answer to `user` (a question node), or more of the answer `continuing` (cut off: the model goes
// on from its last word); true if any text came back.
async function generate(chat, user, continuing = null) {
  // The engine continues after the text without its trailing spaces (as transformers does): so does the page.
  if (continuing) continuing.text = continuing.text.trimEnd();
  let request;
  try {
    request = chatRequest(pathOf(chat).slice(0, pathOf(chat).indexOf(continuing ?? user) + 1),
                          { settings, limits: app.limits, model: app.model });
  } catch (err) {
    showError(err.message);
    return false;
  }
  ui.sendNote.hidden = !request.note;
  ui.sendNote.textContent = request.note;
  if (continuing) Object.assign(request.body, { add_generation_prompt: false, continue_final_message: true });
  const node = continuing ?? addChild(chat, user.id, { role: "assistant", text: "", status: "streaming" });
  const earlierTokens = continuing ? (node.meta.tokens || 0) : 0;
  const box = messageElement(chat, node, { streaming: true });
  if (continuing) ui.messages.querySelector(`[data-id="${node.id}"]`)?.replaceWith(box);
  else ui.messages.querySelector(`[data-id="${user.id}"]`)?.after(box);
  $("empty-state")?.remove();
  scrollToEnd();

  const controller = new AbortController();
  app.controller = controller;
  app.abortReason = "";
  setBusy(true);
  let frame = 0;
  const render = () => {
    frame = 0;
    const stick = nearBottom();
    showReasoning(box, node, true);
    box.renderer.update(node.text);
    if (app.chat === chat) updateMeter();
    if (stick) scrollToEnd();
  };
  const answer = new AnswerStream(node, (chunks) => {
    box.dataset.chunks = String(chunks);
    if (!frame) frame = requestAnimationFrame(render);  // at most one render per frame
  }, (ahead) => { box.querySelector(".content").dataset.queue = String(ahead); });  // shown by chat.css
  // Until the first words: "Thinking… 12 s", so that a long wait (a queue, a long prompt) shows as one.
  const waiting = setInterval(() => {
    box.querySelector(".content").dataset.wait = `${Math.round((performance.now() - answer.t0) / 1000)} s`;
  }, 1000);
  node.status = "done";
  try {
    await answer.read(request.body, controller);
  } catch (err) {
    if (err.name === "AbortError" && !app.abortReason) node.status = "stopped";
    else if (app.abortReason) {
      node.status = "error";
      showError(app.abortReason, { transient: true });
    } else if (err instanceof TypeError) {
      node.status = "error";
      await showNetworkError(answer.chunks > 0);
    } else {
      node.status = "error";
      const lost = /lost|unexpectedly|not reachable/.test(err.message);
      showError(err.message, { transient: lost || err.status === 503 });
    }
  } finally {
    clearInterval(waiting);
    if (frame) cancelAnimationFrame(frame);
    render();
    if (app.controller === controller) app.controller = null;
    setBusy(false);
  }
  if (!node.text && !node.reasoning) {   // (a continued answer always has its earlier text)
    removeMessage(chat, node.id);
    box.remove();
    if (app.chat === chat) renderConversation();
    return false;
  }
  Object.assign(node.meta, answer.meta(earlierTokens));
  chat.updated = Date.now();
  await save(chat);     // stored before it shows as finished: a reload right after keeps the answer
  finishElement(chat, box, node);
  if (app.chat === chat) { updateMeter(); if (nearBottom()) scrollToEnd(); }
  return true;
}

// A fetch that failed on the network: was it the server, or only this connection? The status light is asked
// again at once, so that the message and the light never disagree.
async function showNetworkError(began) {
  const state = await status.check();
  if (state === "ready") {
    showError(began ? "The connection to the chat server dropped during the answer; the server answers again, so Retry should work."
      : "The request did not reach the chat server (the connection failed); the server answers again: send once more.");
  } else {
    showError(`Could not reach the chat server: ${status.detail || state}. Is the app still running?`, { transient: true });
  }
}

function stop() {
  // Aborting the fetch closes the connection; the proxy closes its upstream request and the engine stops.
  app.controller?.abort();
}

// ---- message actions ----------------------------------------------------------------------------------------
const onAction = messageActions({ app, ui, save, generate, renderConversation, removeMessage, hideError, showError });

ui.messages.addEventListener("click", (e) => {
  const b = e.target.closest(".actions button[data-action]");
  if (b) onAction(b.dataset.action, b.closest(".msg").dataset.id, b);
});
handleCodeCopy(ui.messages);
// "Find…" on an image: the grounding question, with that image attached unless it is already the latest.
handleFind(ui.messages, (id, index) => {
  const image = app.chat.nodes[id]?.images?.[index];
  if (!image) return;
  if (image !== pathOf(app.chat).flatMap((n) => n.images || []).at(-1) || attachments.images.length) attachments.attachImage(image);
  askToFind(ui.prompt);
});
initScrollButton(ui.messages);

// ---- composer -----------------------------------------------------------------------------------------------
function autoresize() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${ui.prompt.scrollHeight}px`;     // the stylesheet's max-height caps it
}

ui.form.addEventListener("submit", (e) => { e.preventDefault(); send(); });
ui.stop.addEventListener("click", stop);
ui.prompt.addEventListener("input", () => { autoresize(); app.drafts.keep(); saving.refresh(); });
ui.prompt.addEventListener("focus", () => saving.refresh());
addEventListener("focus", () => saving.refresh());
document.addEventListener("visibilitychange", () => { if (!document.hidden) saving.refresh(); });
addEventListener("pagehide", () => app.drafts.flush());
ui.prompt.addEventListener("keydown", (e) => {
  // isComposing: Enter that confirms an IME candidate (Chinese, Japanese…) must not send.
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
ui.prompt.addEventListener("paste", (e) => {
  const files = [...(e.clipboardData?.files || [])];
  if (files.length) { e.preventDefault(); attachments.addFiles(files); }
});
$("new-chat").addEventListener("click", startNewChat);

// ---- start ----------------------------------------------------------------------------------------------------
async function start() {
  initShell({ stop, newChat: startNewChat, isBusy: () => Boolean(app.controller), attachments });
  attachments.render();
  status.start();
  const [config] = await Promise.all([loadPageConfig(), app.store.open(), app.drafts.open()]);
  if (Number.isFinite(config.max_upload_bytes)) app.limits.maxBytes = attachments.maxBytes = config.max_upload_bytes;
  attachments.pdf = (config.vendor || []).includes("pdfjs");
  await loadLibraries(config.vendor);
  app.chats = await app.store.all();
  app.sidebar = new Sidebar({
    chats: () => app.chats, current: () => app.chat, open: openChat, newChat: startNewChat, error: showError,
    // A new title is not new activity: the chat keeps its place in the list.
    rename: async (id, title) => { const c = app.chats.find((x) => x.id === id); c.title = title; await save(c); },
    remove: async (id) => {
      app.chats = app.chats.filter((c) => c.id !== id);
      await app.store.delete(id);
      await app.drafts.clear(id);
      saving.tabs.deleted(id);
      if (app.chat.id === id) openChat(null); else app.sidebar.render();
    },
    save: (chat) => save(chat),
    importChats: async (list) => { for (const c of list) await save(c); openChat(list[0]?.id ?? app.chat.id); },
  });
  if (!app.store.persistent) $("chat-empty").dataset.note = "Chats cannot be saved in this browser window.";
  openChat(localStorage.getItem("localchat.chat"), { replaceDraft: false });
  document.body.dataset.ready = "true";
  if (document.activeElement === document.body) ui.prompt.focus();   // unless the user is already elsewhere
}

const started = start();

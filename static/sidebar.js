// The list of saved chats, pinned ones first, the rest under the day they were last written (Today, Yesterday…):
// new, open, search, pin, rename, delete (asks once more), export one (JSON or Markdown) or all, import.
import { exportDocument, parseImport, pathOf } from "./conversation.js";
import { dayGroup, fullTime } from "./dates.js";
import { chatMarkdown } from "./export_md.js";
import { initAutoTitleToggle } from "./autotitle.js";
import { el } from "./dom.js";

const $ = (id) => document.getElementById(id);

function download(name, text, type = "application/json") {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

function slug(title) {
  return (title || "chat").toLowerCase().replace(/[^\p{L}\p{N}]+/gu, "-").replace(/^-|-$/g, "").slice(0, 40) || "chat";
}

function groupHeading(text) {
  const li = el("li", "chat-group", text);
  li.setAttribute("role", "presentation");
  return li;
}

const TOOLS = [["pin", "☆", "Pin"], ["rename", "✎", "Rename"], ["export", "⇩", "Export as JSON"],
               ["markdown", "M↓", "Export as Markdown"], ["delete", "✕", "Delete"]];

export class Sidebar {
  // app: {chats(), current(), open(id), newChat(), rename(id, title), remove(id), importChats(list), error(msg),
  //       save(chat)}
  constructor(app) {
    this.app = app;
    this.list = $("chat-list");
    this.search = $("chat-search");
    this.search.addEventListener("input", () => this.render());
    $("export-all").addEventListener("click", () => this.exportAll());
    $("import-chats").addEventListener("click", () => $("import-file").click());
    $("import-file").addEventListener("change", () => this.importFile());
    this.list.addEventListener("click", (e) => this.onClick(e));
    initAutoTitleToggle($("auto-title"));
  }

  render() {
    const query = this.search.value.trim().toLowerCase();
    const current = this.app.current();
    const items = this.app.chats().filter((chat) => !query || chat.title.toLowerCase().includes(query)
      || pathOf(chat).some((n) => n.text.toLowerCase().includes(query)));
    const ordered = [...items.filter((c) => c.pinned), ...items.filter((c) => !c.pinned)];   // a stable sort
    let group = null;
    this.list.replaceChildren(...ordered.flatMap((chat) => {
      const heading = chat.pinned ? "Pinned" : dayGroup(chat.updated);
      const before = heading === group ? [] : [groupHeading(heading)];
      group = heading;
      return [...before, this.item(chat, current)];
    }));
    $("chat-empty").hidden = items.length > 0;
    $("chat-empty").textContent = query ? "No chat matches." : "Chats you start are kept in this browser.";
  }

  item(chat, current) {
    const li = document.createElement("li");
    li.className = "chat-item";
    li.dataset.id = chat.id;
    if (current && chat.id === current.id) li.setAttribute("aria-current", "true");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "chat-open";
    open.dataset.action = "open";
    open.textContent = chat.title || "Untitled chat";
    open.title = `${chat.title}\n${fullTime(chat.updated)}`;
    const tools = document.createElement("span");
    tools.className = "chat-tools";
    for (const [action, text, label] of TOOLS) {
      const b = document.createElement("button");
      b.type = "button";
      b.className = `chat-${action}`;
      b.dataset.action = action;
      b.textContent = action === "pin" && chat.pinned ? "★" : text;
      b.title = `${action === "pin" && chat.pinned ? "Unpin" : label} “${chat.title || "Untitled chat"}”`;
      b.setAttribute("aria-label", b.title);
      if (action === "pin") b.setAttribute("aria-pressed", String(Boolean(chat.pinned)));
      tools.append(b);
    }
    if (chat.pinned) li.classList.add("pinned");
    li.append(open, tools);
    return li;
  }

  onClick(e) {
    const b = e.target.closest("button[data-action]");
    if (!b) return;
    const li = b.closest(".chat-item");
    const chat = this.app.chats().find((c) => c.id === li.dataset.id);
    if (!chat) return;
    const action = b.dataset.action;
    if (action === "open") this.app.open(chat.id);
    else if (action === "export") download(`${slug(chat.title)}.localchat.json`, JSON.stringify(exportDocument([chat]), null, 1));
    else if (action === "markdown") download(`${slug(chat.title)}.md`, chatMarkdown(chat), "text/markdown");
    else if (action === "pin") { chat.pinned = !chat.pinned; this.app.save(chat); }
    else if (action === "rename") this.rename(li, chat);
    else if (action === "delete") {
      // A second click within a few seconds confirms; nothing modal.
      if (b.dataset.armed) { this.app.remove(chat.id); return; }
      b.dataset.armed = "1";
      b.textContent = "Delete?";
      b.classList.add("armed");
      setTimeout(() => { if (b.isConnected) { delete b.dataset.armed; b.textContent = "✕"; b.classList.remove("armed"); } }, 4000);
    }
  }

  rename(li, chat) {
    const input = document.createElement("input");
    input.className = "chat-rename-input";
    input.value = chat.title;
    input.setAttribute("aria-label", "Chat title");
    li.replaceChildren(input);
    input.focus();
    input.select();
    let finished = false;
    const finish = (save) => {
      if (finished) return;
      finished = true;
      if (save && input.value.trim()) this.app.rename(chat.id, input.value.trim());
      else this.render();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") finish(true);
      if (e.key === "Escape") { e.stopPropagation(); finish(false); }
    });
    input.addEventListener("blur", () => finish(true));
  }

  exportAll() {
    const stamp = new Date().toISOString().slice(0, 10);
    download(`localchat-${stamp}.json`, JSON.stringify(exportDocument(this.app.chats()), null, 1));
  }

  async importFile() {
    const input = $("import-file");
    const files = [...input.files];
    input.value = "";
    for (const file of files) {
      try {
        const chats = parseImport(JSON.parse(await file.text()));
        await this.app.importChats(chats);
      } catch (err) {
        this.app.error(`Import of “${file.name}” failed: ${err instanceof SyntaxError ? "not a JSON file" : err.message}`);
      }
    }
  }
}

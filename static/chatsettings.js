// Generation settings per chat: the settings form shows the open chat's own values and every change is saved
// with that chat; a new chat starts from the defaults, which "Use for new chats" sets to the form's values.
import { FIELDS } from "./settings.js";
import { el } from "./dom.js";

const $ = (id) => document.getElementById(id);
const IDS = [...Object.keys(FIELDS), "system-prompt", "stop-strings"];
const KEY = "localchat.chat-defaults";

function snapshot() {
  return Object.fromEntries(IDS.map((id) => [id, $(id).value]));
}

function storedDefaults() {
  try { return JSON.parse(localStorage.getItem(KEY)) || null; } catch { return null; }
}

export class ChatSettings {
  // app: {current() -> the open chat, save(chat), validate()}
  constructor(app) {
    this.app = app;
    this.defaults = storedDefaults() ?? snapshot();   // the first time: the settings the page kept until now
    const row = el("div", "settings-row chat-settings");
    const note = el("span", "note", "These settings belong to this chat.");
    const use = el("button", "ghost small", "Use for new chats");
    use.type = "button";
    use.id = "settings-as-default";
    use.addEventListener("click", () => {
      this.defaults = snapshot();
      localStorage.setItem(KEY, JSON.stringify(this.defaults));
      use.textContent = "Saved for new chats";
      setTimeout(() => { use.textContent = "Use for new chats"; }, 1500);
    });
    row.append(note, use);
    const body = $("settings").querySelector(".settings-body");
    if (body) body.prepend(row); else $("settings").append(row);
    // Typed values belong to the chat at once; a finished change (or a preset) is saved with it.
    $("settings").addEventListener("input", (e) => { if (IDS.includes(e.target.id)) this.capture(false); });
  }

  // The open chat's settings into the form (a chat without its own gets the defaults).
  show(chat) {
    const values = chat.settings ?? this.defaults;
    for (const id of IDS) $(id).value = values[id] ?? "";
    this.app.validate();
  }

  capture(save = true) {
    const chat = this.app.current();
    chat.settings = snapshot();
    if (save) this.app.save(chat);
  }
}

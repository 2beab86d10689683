// The message being written, per chat: the composer's text and attachments (images, videos, files), kept in
// IndexedDB (a database of its own, so the chats' schema is untouched) so that a reload or a closed tab loses
// nothing. Written shortly after each change; removed when the message is sent. Without IndexedDB, drafts last
// as long as the page.

const DB_NAME = "localchat-drafts";
const STORE = "drafts";
const WRITE_DELAY_MS = 300;

function promised(request) {
  return new Promise((resolve, reject) => {
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}

export class Drafts {
  // prompt: the message box; attachments: its Attachments; resize(): fits the box to a restored text.
  constructor({ prompt, attachments, resize }) {
    this.prompt = prompt;
    this.attachments = attachments;
    this.resize = resize;
    this.db = null;
    this.memory = new Map();
    this.timer = 0;
    this.pending = null;
    this.chatId = null;     // the chat whose draft the composer shows; null while it is being loaded
    this.loads = 0;
  }

  async open() {
    try {
      const request = indexedDB.open(DB_NAME, 1);
      request.onupgradeneeded = () => request.result.createObjectStore(STORE, { keyPath: "chat" });
      this.db = await promised(request);
    } catch {
      this.db = null;
    }
    return this;
  }

  async get(chatId) {
    if (this.pending?.chat === chatId) return this.pending;
    if (!this.db) return this.memory.get(chatId) || null;
    try { return (await promised(this.db.transaction(STORE).objectStore(STORE).get(chatId))) || null; } catch { return null; }
  }

  // Keeps what the composer holds as the draft of its chat, written a moment later (not once per key).
  keep() {
    if (this.chatId === null) return;
    this.pending = { chat: this.chatId, text: this.prompt.value, ...this.attachments.content() };
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.flush(), WRITE_DELAY_MS);
  }

  // Shows chat `chatId`'s draft in the composer: in place of what it holds (`replace`, switching chats), or
  // only where it is empty (at the start, what was typed before the page was ready stays).
  async load(chatId, { replace }) {
    const flushed = this.flush();             // takes the draft of the chat being left before anything awaits
    this.chatId = null;
    const load = ++this.loads;
    if (replace) { this.prompt.value = ""; this.attachments.clear(); this.resize(); }   // never the old chat's
    await flushed;
    const draft = await this.get(chatId);
    if (load !== this.loads) return;          // another chat was opened meanwhile
    if (replace || !this.prompt.value) { this.prompt.value = draft?.text || ""; this.resize(); }
    if (replace || !this.attachments.count()) this.attachments.restore(draft || {});
    this.chatId = chatId;
  }

  async flush() {
    clearTimeout(this.timer);
    const draft = this.pending;
    this.pending = null;
    if (!draft) return;
    const empty = !draft.text && !draft.images.length && !draft.videos?.length && !draft.files?.length;
    if (!this.db) { if (empty) this.memory.delete(draft.chat); else this.memory.set(draft.chat, draft); return; }
    try {
      const store = this.db.transaction(STORE, "readwrite").objectStore(STORE);
      await promised(empty ? store.delete(draft.chat) : store.put(draft));
    } catch { /* a draft is a courtesy: a full disk must not stop the chat */ }
  }

  async clear(chatId) {
    clearTimeout(this.timer);
    this.pending = { chat: chatId, text: "", images: [] };
    await this.flush();
  }
}

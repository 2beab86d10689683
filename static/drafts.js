// The message being written, per chat: its text and attached images, kept in IndexedDB (a database of its own,
// so the chats' schema is untouched) so that a reload or a closed tab loses nothing. Written shortly after each
// change; removed when the message is sent. Without IndexedDB, drafts last as long as the page.

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
  constructor() {
    this.db = null;
    this.memory = new Map();
    this.timer = 0;
    this.pending = null;
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

  // Keeps {text, images} as the draft of chat `chatId`, written a moment later (typing does not write per key).
  keep(chatId, text, images) {
    this.pending = { chat: chatId, text, images };
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.flush(), WRITE_DELAY_MS);
  }

  async flush() {
    clearTimeout(this.timer);
    const draft = this.pending;
    this.pending = null;
    if (!draft) return;
    const empty = !draft.text && !draft.images.length;
    if (!this.db) { if (empty) this.memory.delete(draft.chat); else this.memory.set(draft.chat, draft); return; }
    try {
      const store = this.db.transaction(STORE, "readwrite").objectStore(STORE);
      await promised(empty ? store.delete(draft.chat) : store.put(draft));
    } catch { /* a draft is a courtesy: a full disk must not stop the chat */ }
  }

  async clear(chatId) {
    this.keep(chatId, "", []);
    await this.flush();
  }
}

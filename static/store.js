// Chats kept in the browser's IndexedDB (images included, as data URLs), one record per chat. Where IndexedDB
// cannot be opened (a private window that refuses it), chats live for this page only and the sidebar says so.

const DB_NAME = "localchat";
const STORE = "chats";

function promised(request) {
  return new Promise((resolve, reject) => {
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}

export class ChatStore {
  constructor() {
    this.db = null;
    this.persistent = false;
    this.memory = new Map();
  }

  async open() {
    try {
      const request = indexedDB.open(DB_NAME, 1);
      request.onupgradeneeded = () => request.result.createObjectStore(STORE, { keyPath: "id" });
      this.db = await promised(request);
      this.persistent = true;
    } catch {
      this.db = null;
    }
    return this;
  }

  tx(mode) { return this.db.transaction(STORE, mode).objectStore(STORE); }

  async all() {
    const chats = this.db ? await promised(this.tx("readonly").getAll()) : [...this.memory.values()];
    return chats.sort((a, b) => b.updated - a.updated);
  }

  async put(chat) {
    // A structured clone of the chat as it is now: later edits in memory do not reach the stored copy.
    if (this.db) await promised(this.tx("readwrite").put(chat));
    else this.memory.set(chat.id, structuredClone(chat));
  }

  async delete(id) {
    if (this.db) await promised(this.tx("readwrite").delete(id));
    else this.memory.delete(id);
  }
}

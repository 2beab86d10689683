// Chats kept in the browser's IndexedDB (images included, as data URLs), one record per chat. Where IndexedDB
// cannot be opened (a private window that refuses it), chats live for this page only and the sidebar says so.
//
// Two tabs may hold the same chat. A save never overwrites what another tab stored since: within one
// transaction the stored record is read and merged into the chat being saved (mergeChats), by message ids.
// Deleted messages are remembered as ids in `chat.removed`, so that a merge does not bring them back.

const DB_NAME = "localchat";
const STORE = "chats";

function promised(request) {
  return new Promise((resolve, reject) => {
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}

// Records the ids of message `id` and everything below it as deleted; call before removing them from the tree.
export function noteRemoved(chat, id) {
  const removed = new Set(chat.removed || []);
  const stack = [id];
  while (stack.length) {
    const node = chat.nodes[stack.pop()];
    if (!node) continue;
    removed.add(node.id);
    stack.push(...node.children);
  }
  chat.removed = [...removed];
}

// Brings into `chat` (in place) the messages of `stored` that it lacks, and drops those either side deleted.
// What both hold stays as `chat` has it (the tab saving now is the newer word on those). True if anything changed.
export function mergeChats(chat, stored) {
  if (!stored?.nodes || stored.id !== chat.id) return false;
  const removed = new Set([...(chat.removed || []), ...(stored.removed || [])]);
  let changed = removed.size !== (chat.removed || []).length;
  chat.removed = [...removed];
  for (const [id, node] of Object.entries(stored.nodes)) {
    if (removed.has(id) || chat.nodes[id]) continue;
    chat.nodes[id] = structuredClone(node);
    chat.nodes[id].sel = Math.min(node.sel ?? 0, Math.max(0, node.children.length - 1));
    changed = true;
  }
  for (const [id, node] of Object.entries(chat.nodes)) {
    if (removed.has(id)) { delete chat.nodes[id]; changed = true; continue; }
    const theirs = stored.nodes[id]?.children || [];
    const children = [...node.children, ...theirs.filter((c) => !node.children.includes(c))]
      .filter((c) => !removed.has(c));
    if (children.length !== node.children.length || children.some((c, i) => c !== node.children[i])) changed = true;
    node.children = children;
  }
  for (const node of Object.values(chat.nodes)) {
    node.children = node.children.filter((c) => chat.nodes[c]);
    node.sel = Math.max(0, Math.min(node.sel ?? 0, node.children.length - 1));
  }
  if (!chat.title && stored.title) { chat.title = stored.title; changed = true; }
  chat.updated = Math.max(chat.updated || 0, stored.updated || 0);
  return changed;
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

  async get(id) {
    return this.db ? promised(this.tx("readonly").get(id)) : this.memory.get(id);
  }

  // Merges what is stored of this chat into it (another tab may have added to it); true if anything changed.
  async refresh(chat) {
    return mergeChats(chat, await this.get(chat.id));
  }

  // Saves the chat merged with its stored copy, in one transaction; true if the merge changed the chat.
  async put(chat) {
    if (!this.db) {
      const changed = mergeChats(chat, this.memory.get(chat.id));
      this.memory.set(chat.id, structuredClone(chat));
      return changed;
    }
    // The chat as it is now: what happens to it while the stored copy is read (an answer starts) is not saved.
    const copy = structuredClone(chat);
    const store = this.tx("readwrite");
    const stored = await promised(store.get(chat.id));
    mergeChats(copy, stored);
    await promised(store.put(copy));
    return mergeChats(chat, stored);
  }

  async delete(id) {
    if (this.db) await promised(this.tx("readwrite").delete(id));
    else this.memory.delete(id);
  }
}

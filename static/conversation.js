// A chat is a tree of messages: regenerating an answer adds a sibling answer, editing a question adds a sibling
// question (a new branch from there). Each node remembers which child is shown (`sel`); the conversation on
// screen, and the one sent to the model, is the path of selected children from the root.
// Pure data, no DOM: the page, the store (IndexedDB) and export/import all share this shape.

export const CHAT_FORMAT = "localchat-chats";
export const CHAT_VERSION = 1;

export function uid() {
  return (crypto.randomUUID?.() || `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`);
}

export function newChat() {
  const now = Date.now();
  return { id: uid(), title: "", created: now, updated: now, nodes: { root: { id: "root", children: [], sel: 0 } } };
}

// A node: {id, parent, role: "user" | "assistant", text, images: [{url, name, width, height, page?}],
//          videos: [{url, name, bytes, duration, width, height, poster, frames}], files: [{name, text, bytes}],
//          children, sel,
//          status: "done" | "stopped" | "error", time (ms since the epoch, when it was written),
//          meta: {ttftMs, tokens, rate, finish, promptTokens, note, edited}}
// A chat may also carry `pinned` (kept at the top of the list) and `settings` (its own generation settings,
// form field id -> value: chatsettings.js).
export function addChild(chat, parentId, fields) {
  const parent = chat.nodes[parentId];
  const node = { id: uid(), parent: parentId, role: "user", text: "", images: [], children: [], sel: 0,
                 status: "done", time: Date.now(), meta: {}, ...fields };
  chat.nodes[node.id] = node;
  parent.children.push(node.id);
  parent.sel = parent.children.length - 1;
  chat.updated = Date.now();
  return node;
}

export function pathOf(chat) {
  const out = [];
  let node = chat.nodes.root;
  while (node.children.length) {
    node = chat.nodes[node.children[Math.min(node.sel, node.children.length - 1)]];
    out.push(node);
  }
  return out;
}

export function siblingInfo(chat, id) {
  const node = chat.nodes[id];
  const siblings = chat.nodes[node.parent].children;
  return { index: siblings.indexOf(id), count: siblings.length };
}

export function selectSibling(chat, id, delta) {
  const parent = chat.nodes[chat.nodes[id].parent];
  const i = parent.children.indexOf(id) + delta;
  if (i >= 0 && i < parent.children.length) parent.sel = i;
}

export function removeNode(chat, id) {
  const node = chat.nodes[id];
  const parent = chat.nodes[node.parent];
  const i = parent.children.indexOf(id);
  parent.children.splice(i, 1);
  parent.sel = Math.max(0, Math.min(parent.sel, parent.children.length - 1));
  const stack = [id];
  while (stack.length) {
    const n = chat.nodes[stack.pop()];
    stack.push(...n.children);
    delete chat.nodes[n.id];
  }
  chat.updated = Date.now();
}

export function titleFrom(text) {
  const line = (text || "").trim().split("\n")[0].replace(/\s+/g, " ");
  return line.length > 60 ? `${line.slice(0, 57)}…` : line || "Image chat";
}

// ---- what is sent ---------------------------------------------------------------------------------------
// The media a message carries, in the order its content parts go: images (PDF pages among them), then videos.
const MEDIA = [
  { key: "images", limit: "maxImages", part: (m) => ({ type: "image_url", image_url: { url: m.url } }),
    omitted: (n) => (n === 1 ? "(an earlier image, not sent again)" : `(${n} earlier images, not sent again)`) },
  { key: "videos", limit: "maxVideos", part: (m) => ({ type: "video_url", video_url: { url: m.url } }),
    omitted: (n) => (n === 1 ? "(an earlier video, not sent again)" : `(${n} earlier videos, not sent again)`) },
];

// A text file as the model reads it: its name, then its text in a fence longer than any run of backticks inside.
export function fileBlock(file) {
  const longest = Math.max(2, ...[...file.text.matchAll(/`{3,}/g)].map((m) => m[0].length));
  const fence = "`".repeat(longest + 1);
  const lang = /\.([\w+-]+)$/.exec(file.name)?.[1]?.toLowerCase() || "";
  return `${file.name}:\n${fence}${lang}\n${file.text.replace(/\n$/, "")}\n${fence}`;
}

// What one question says in words: the notes on media not sent again, its text files, then what was typed.
function userText(node, omitted) {
  const words = [...(node.files || []).map(fileBlock), node.text].filter(Boolean).join("\n\n");
  return [...omitted, words].filter(Boolean).join("\n");
}

// OpenAI messages for the path, keeping the newest images and videos that fit the engine's per-prompt limits
// (maxImages, maxVideos) and, all together, the proxy's body size limit; older ones are replaced by a short
// text so the turn still reads right. With keepEarlier false only the last message's media are sent. Returns
// {messages, dropped, droppedVideos, droppedLast}: droppedLast counts media of the last message itself that do
// not fit (the page refuses to send those).
export function buildMessages(path, { system = "", maxImages = 8, maxVideos = 1, maxBytes = Infinity,
                                      keepEarlier = true } = {}) {
  const limits = { maxImages, maxVideos };
  const base = path.map((n) => ({ role: n.role, content: userText(n, []) }));
  let bytes = JSON.stringify(base).length + system.length + 4096;  // the rest of the body, with room to spare
  const count = { images: 0, videos: 0 };
  const dropped = { images: 0, videos: 0 };
  let droppedLast = 0;
  const keep = new Map();   // `${node id} ${kind}` -> media kept
  for (let i = path.length - 1; i >= 0; i--) {
    for (const { key, limit } of MEDIA) {
      const items = path[i][key] || [];
      if (!items.length) continue;
      const kept = [];
      // Newest first: within a message too, so that the last media of a message are the ones kept.
      for (const item of [...items].reverse()) {
        const allowed = (keepEarlier || i === path.length - 1) && count[key] < limits[limit]
          && bytes + item.url.length + 64 <= maxBytes;
        if (allowed) { kept.unshift(item); count[key] += 1; bytes += item.url.length + 64; } else if (i === path.length - 1) droppedLast += 1;
        else dropped[key] += 1;
      }
      keep.set(`${path[i].id} ${key}`, kept);
    }
  }
  const messages = system ? [{ role: "system", content: system }] : [];
  for (const node of path) {
    const media = MEDIA.filter(({ key }) => node[key]?.length);
    if (node.role !== "user" || !media.length) { messages.push({ role: node.role, content: userText(node, []) }); continue; }
    const parts = [];
    const omitted = [];
    for (const { key, part, omitted: say } of media) {
      const kept = keep.get(`${node.id} ${key}`);
      parts.push(...kept.map(part));
      if (node[key].length > kept.length) omitted.push(say(node[key].length - kept.length));
    }
    const text = userText(node, omitted);
    if (text) parts.push({ type: "text", text });
    messages.push({ role: "user", content: parts });
  }
  return { messages, dropped: dropped.images, droppedVideos: dropped.videos, droppedLast };
}

// ---- export / import -------------------------------------------------------------------------------------
export function exportDocument(chats) {
  return { format: CHAT_FORMAT, version: CHAT_VERSION, exported: new Date().toISOString(), chats };
}

function validNode(node, id) {
  return node && typeof node === "object" && node.id === id && Array.isArray(node.children)
    && (id === "root" || (["user", "assistant"].includes(node.role) && typeof node.text === "string"));
}

// A video of an imported chat, its poster an inline image (never an address to fetch) and its numbers numbers.
function importedVideo(v) {
  const num = (x) => (Number.isFinite(x) && x > 0 ? x : 1);
  return { url: v.url, name: String(v.name || "video"), bytes: num(v.bytes), duration: num(v.duration),
           width: num(v.width), height: num(v.height), frames: Math.round(num(v.frames)),
           poster: /^data:image\//.test(v.poster || "") ? v.poster : "" };
}

// The chats in an exported document (one chat object, or the export of several); throws with a message that
// says what is wrong. Imported chats get fresh ids, so importing twice keeps both copies.
export function parseImport(doc) {
  const list = doc?.format === CHAT_FORMAT ? doc.chats : doc?.nodes ? [doc] : null;
  if (!Array.isArray(list)) throw new Error("This file is not a Local Chat export (no \"chats\" list).");
  return list.map((chat, i) => {
    const nodes = chat?.nodes;
    if (!nodes || !validNode(nodes.root, "root")
        || !Object.entries(nodes).every(([id, n]) => validNode(n, id) && n.children.every((c) => c in nodes))) {
      throw new Error(`Chat ${i + 1} in this file is damaged (its messages do not form a conversation).`);
    }
    for (const n of Object.values(nodes)) {
      n.images = Array.isArray(n.images) ? n.images.filter((im) => /^data:image\//.test(im?.url || "")) : [];
      n.videos = Array.isArray(n.videos) ? n.videos.filter((v) => /^data:video\//.test(v?.url || "")).map(importedVideo) : [];
      n.files = Array.isArray(n.files) ? n.files.filter((f) => typeof f?.name === "string" && typeof f.text === "string") : [];
      n.meta = n.meta && typeof n.meta === "object" ? n.meta : {};
      n.sel = Number.isInteger(n.sel) ? n.sel : 0;
    }
    const now = Date.now();
    const settings = chat.settings && typeof chat.settings === "object"
      ? Object.fromEntries(Object.entries(chat.settings).filter(([, v]) => typeof v === "string")) : undefined;
    return { id: uid(), title: String(chat.title || ""), created: Number(chat.created) || now,
             updated: Number(chat.updated) || now, nodes, pinned: chat.pinned === true, settings };
  });
}

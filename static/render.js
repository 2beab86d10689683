// Model output to DOM, block by block, so that streaming never rebuilds what is already on screen: a text
// selection in an earlier paragraph survives, and nothing flickers. The answer is cut into blocks at blank
// lines outside code fences and $$ math; every block but the last is finished and rendered once, only the
// last (still growing) block is re-rendered as tokens arrive.
//
// Rendering uses the libraries run_app.sh copies into static/vendor/ (marked, DOMPurify, highlight.js, KaTeX)
// where they exist, else markdown.js: plain markdown, equally safe (model text only ever becomes text nodes
// or sanitized markup). Raw HTML in an answer is always shown as text.
import { renderMarkdown, safeLink, imageElement } from "./markdown.js";
import { copyWithFeedback } from "./copy.js";

const lib = { marked: null, purify: null, hljs: null, katex: null };

async function importDefault(path, name) {
  const mod = await import(path);
  return mod[name] || mod.default;
}

function addStylesheet(href, media) {
  const link = document.createElement("link");
  link.rel = "stylesheet";
  link.href = href;
  if (media) link.media = media;
  document.head.append(link);
  return link;
}

// Loads the libraries /api/page-config lists; a library that fails to load is simply not used.
export async function loadLibraries(available) {
  const has = new Set(available || []);
  const jobs = [];
  if (has.has("marked") && has.has("dompurify")) {
    jobs.push(importDefault("/static/vendor/marked.esm.js", "marked").then((m) => { lib.marked = configureMarked(m); }),
              importDefault("/static/vendor/purify.es.mjs").then((p) => { lib.purify = p; }));
  }
  if (has.has("highlight")) {
    jobs.push(importDefault("/static/vendor/highlight.min.mjs").then((h) => { lib.hljs = h; }));
    // One stylesheet per theme; shell.js switches which one applies.
    const theme = document.documentElement.dataset.theme || "light";
    for (const name of ["light", "dark"]) {
      addStylesheet(`/static/vendor/hljs-${name}.css`, theme === name ? "all" : "not all").dataset.theme = name;
    }
  }
  if (has.has("katex")) {
    jobs.push(importDefault("/static/vendor/katex/katex.mjs").then((k) => { lib.katex = k; }));
    addStylesheet("/static/vendor/katex/katex.min.css");
  }
  await Promise.allSettled(jobs);
  if (!lib.purify) lib.marked = null;   // never markup without the sanitizer
  document.documentElement.dataset.renderer = lib.marked ? "marked" : "builtin";
  return { ...lib };
}

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function configureMarked(marked) {
  // Raw HTML written by the model is shown as text, never parsed.
  marked.use({ gfm: true, breaks: true, renderer: { html: (token) => escapeHtml(token.text ?? token.raw ?? "") } });
  return marked;
}

// ---- blocks ---------------------------------------------------------------------------------------------
// A fence may be indented as far as it likes: inside a list item it carries the item's indentation.
const FENCE = /^\s*(`{3,}|~{3,})/;
const LIST_ITEM = /^\s{0,3}([-*+]|\d{1,9}[.)])(\s|$)/;

// A blank line ends a block, except inside a list: there the next line that is indented (the item goes on) or
// is another item keeps the list one block, so its nesting, paragraphs and code stay inside it.
function listGoesOn(block, line) {
  return block.some((l) => LIST_ITEM.test(l)) && (/^\s{2,}\S/.test(line) || LIST_ITEM.test(line));
}

export function splitBlocks(text) {
  const blocks = [];
  let current = [];
  let blanks = 0;     // blank lines seen after `current`, not yet known to end it
  let fence = null;
  let math = false;
  for (const line of text.replace(/\r\n?/g, "\n").split("\n")) {
    const f = FENCE.exec(line);
    if (!fence && !math && !line.trim()) { if (current.length) blanks++; continue; }
    if (blanks) {
      if (!fence && !math && !listGoesOn(current, line)) { blocks.push(current.join("\n")); current = []; }
      else current.push(...Array(blanks).fill(""));
      blanks = 0;
    }
    if (fence) {
      if (f && f[1][0] === fence[0] && f[1].length >= fence.length && !line.trim().slice(f[1].length)) fence = null;
    } else if (f) {
      fence = f[1];
    } else if ((line.match(/\$\$/g) || []).length % 2 === 1) {
      math = !math;
    }
    current.push(line);
  }
  blocks.push(current.join("\n"));   // the last block, possibly still open (may be "")
  return blocks;
}

// ---- math -----------------------------------------------------------------------------------------------
// Display: $$…$$, \[…\]; inline: \(…\), $…$ (no space inside the dollars, no digit after: "$5 and $10" is money).
const MATH = /\$\$([\s\S]+?)\$\$|\\\[([\s\S]+?)\\\]|\\\(([\s\S]+?)\\\)|(?<![\\$\w])\$(?=[^\s$])((?:\\\$|[^$\n])+?)(?<=[^\s\\])\$(?![\d$])/g;

// Math spans outside code become private-use placeholders before markdown runs (so `_` and `\\` in TeX are not
// taken as markdown), and KaTeX output afterwards.
function protectMath(src) {
  const spans = [];
  if (FENCE.test(src)) return { src, spans };
  const out = src.split(/(`+[^`]*`+)/).map((piece, i) => (i % 2 ? piece : piece.replace(MATH, (m, d1, d2, i1, i2) => {
    spans.push({ tex: d1 ?? d2 ?? i1 ?? i2, display: d1 !== undefined || d2 !== undefined });
    return `\uE000${spans.length - 1}\uE001`;
  })));
  return { src: out.join(""), spans };
}

function renderMath(root, spans) {
  if (!spans.length) return;
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const hits = [];
  while (walker.nextNode()) if (walker.currentNode.data.includes("\uE000")) hits.push(walker.currentNode);
  for (const textNode of hits) {
    const frag = document.createDocumentFragment();
    for (const [i, piece] of textNode.data.split(/\uE000(\d+)\uE001/).entries()) {
      if (i % 2 === 0) { if (piece) frag.append(piece); continue; }
      const { tex, display } = spans[Number(piece)];
      const span = document.createElement("span");
      span.className = display ? "math math-display" : "math math-inline";
      if (lib.katex) lib.katex.render(tex, span, { displayMode: display, throwOnError: false, output: "htmlAndMathml" });
      else span.textContent = display ? `$$${tex}$$` : `$${tex}$`;
      frag.append(span);
    }
    textNode.replaceWith(frag);
  }
}

// ---- one block ------------------------------------------------------------------------------------------
function codeChrome(pre) {
  const code = pre.querySelector("code") || pre;
  const lang = (/language-([\w+#.-]+)/.exec(code.className) || [])[1] || "";
  if (lib.hljs && lang && lib.hljs.getLanguage(lang)) {
    lib.hljs.highlightElement(code);
  }
  const box = document.createElement("div");
  box.className = "code-block";
  const bar = document.createElement("div");
  bar.className = "code-bar";
  const name = document.createElement("span");
  name.className = "code-lang";
  name.textContent = lang || "code";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", "Copy code");
  bar.append(name, copy);
  pre.replaceWith(box);
  box.append(bar, pre);
}

function libraryBlock(src) {
  const { src: protectedSrc, spans } = protectMath(src);
  const html = lib.marked.parse(protectedSrc, { async: false });
  const frag = lib.purify.sanitize(html, { RETURN_DOM_FRAGMENT: true, FORBID_TAGS: ["style", "form", "input"],
                                           FORBID_ATTR: ["style"] });
  for (const a of [...frag.querySelectorAll("a")]) a.replaceWith(safeLink(a.textContent, a.getAttribute("href") || ""));
  for (const img of [...frag.querySelectorAll("img")]) img.replaceWith(imageElement(img.getAttribute("alt") || "", img.getAttribute("src") || ""));
  for (const pre of [...frag.querySelectorAll("pre")]) codeChrome(pre);
  renderMath(frag, spans);
  return frag;
}

function builtinBlock(src) {
  const { src: protectedSrc, spans } = protectMath(src);
  const frag = renderMarkdown(protectedSrc);
  renderMath(frag, spans);
  return frag;
}

export function renderBlock(src) {
  const box = document.createElement("div");
  box.className = "blk";
  box.append(lib.marked ? libraryBlock(src) : builtinBlock(src));
  return box;
}

// ---- streaming ------------------------------------------------------------------------------------------
export class StreamRenderer {
  constructor(el) {
    this.el = el;
    this.done = [];       // sources of the finished blocks on screen, in order
    this.tail = null;     // element of the last, open block
    this.tailSrc = null;
  }

  update(text) {
    const blocks = splitBlocks(text);
    const finished = blocks.length - 1;
    let keep = 0;
    while (keep < this.done.length && keep < finished && this.done[keep] === blocks[keep]) keep++;
    if (keep < this.done.length) this.reset(keep);   // text changed, not just grew: rebuild from there
    for (let i = this.done.length; i < finished; i++) {
      if (this.tail && this.tailSrc === blocks[i]) {
        this.tail = null;                         // the open block is finished exactly as it is on screen
      } else {
        this.tail?.remove();
        this.tail = null;
        this.el.append(renderBlock(blocks[i]));
      }
      this.tailSrc = null;
      this.done.push(blocks[i]);
    }
    const last = blocks[finished];
    if (last !== this.tailSrc) {
      const node = last.trim() ? renderBlock(last) : null;
      if (this.tail) this.tail.remove();
      if (node) this.el.append(node);
      this.tail = node;
      this.tailSrc = last;
    }
  }

  reset(keep = 0) {
    const nodes = [...this.el.children].filter((n) => n.classList.contains("blk"));
    for (const n of nodes.slice(keep)) n.remove();
    this.done.length = keep;
    this.tail = null;
    this.tailSrc = null;
  }
}

// Copy buttons of code blocks, for every rendered message (one listener on the conversation).
export function handleCodeCopy(container) {
  container.addEventListener("click", (e) => {
    const button = e.target.closest(".code-block .copy");
    if (button) copyWithFeedback(button, button.closest(".code-block").querySelector("pre").textContent);
  });
}

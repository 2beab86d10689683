// A small Markdown renderer for model output that never goes through HTML parsing: every piece of model text
// reaches the page as a text node or textContent, so "<img onerror=…>" in an answer is shown, not run.
// render.js uses it, block by block, where the vendor libraries (marked, DOMPurify) are missing. The last block
// is re-rendered at every streamed chunk, so it must accept half-written input: an unclosed code fence renders
// as a code block, an unclosed ** stays literal until its closing ** arrives.
import { el } from "./dom.js";

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s*>\s?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])(\s+)(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/;

// ---- inline ---------------------------------------------------------------------------------------------
// Tried at every position; the earliest match wins, ties go to the earlier rule (code before emphasis, so
// `**x**` inside backticks stays literal).
const INLINE = [
  { re: /(`+)([\s\S]*?[^`])\1(?!`)/, make: (m) => el("code", null, m[2].replace(/^ (.*) $/s, "$1")) },
  { re: /!\[([^\]\n]*)\]\(([^)\s]+)\)/, make: (m) => imageElement(m[1], m[2]) },
  { re: /\[([^\]\n]+)\]\(([^)\s]+)\)/, make: (m) => link(m[1], m[2]) },
  // A bare URL is its own text: parsing it again for inline rules would find the same URL (endless recursion).
  { re: /\bhttps?:\/\/[^\s<>()\]]*[^\s<>()\].,;:!?'"*_]/, make: (m) => safeLink(m[0], m[0]) },
  { re: /\*\*(?=\S)([\s\S]*?\S)\*\*/, make: (m) => wrap("strong", m[1]) },
  { re: /(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)/, make: (m) => wrap("strong", m[1]) },
  { re: /~~(?=\S)([\s\S]*?\S)~~/, make: (m) => wrap("del", m[1]) },
  { re: /\*(?=[^\s*])([\s\S]*?[^\s*])\*/, make: (m) => wrap("em", m[1]) },
  { re: /(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/, make: (m) => wrap("em", m[1]) },
];

function wrap(tag, inner) {
  const node = el(tag);
  node.append(renderInline(inner));
  return node;
}

function webURL(href) {
  let url;
  try { url = new URL(href, "https://invalid.example/"); } catch { return null; }
  return ["http:", "https:", "mailto:"].includes(url.protocol) && url.host !== "invalid.example" ? url : null;
}

// Only web and mail links become anchors; javascript: and data: URLs stay plain text.
export function safeLink(text, href) {
  const url = webURL(href);
  if (!url) return document.createTextNode(text === href || !href ? text : `[${text}](${href})`);
  const a = el("a");
  a.href = url.href;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  a.textContent = text;
  return a;
}

function link(text, href) {
  const node = safeLink("", href);
  if (node.nodeType === Node.TEXT_NODE) return document.createTextNode(`[${text}](${href})`);
  node.append(renderInline(text));
  return node;
}

// An image in an answer: inline data: images are shown; a web image is fetched only when the user asks (a model
// can be talked into writing image URLs that carry the conversation to someone else's server).
const DATA_IMAGE = /^data:image\/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/=\s]+$/;

export function imageElement(alt, src) {
  if (DATA_IMAGE.test(src)) {
    const img = el("img", "md-image");
    img.src = src;
    img.alt = alt;
    return img;
  }
  const url = webURL(src);
  if (!url || url.protocol === "mailto:") return document.createTextNode(`![${alt}](${src})`);
  const button = el("button", "remote-image", `Image: ${alt || "untitled"} (${url.host}), show`);
  button.type = "button";
  button.title = url.href;
  button.addEventListener("click", () => {
    const img = el("img", "md-image");
    img.src = url.href;
    img.alt = alt;
    img.referrerPolicy = "no-referrer";
    button.replaceWith(img);
  });
  return button;
}

export function renderInline(text) {
  const frag = document.createDocumentFragment();
  let rest = text;
  while (rest) {
    let best = null;
    for (const rule of INLINE) {
      const m = rule.re.exec(rest);
      if (m && (!best || m.index < best.m.index)) best = { m, rule };
    }
    if (!best) { frag.append(document.createTextNode(rest)); break; }
    if (best.m.index > 0) frag.append(document.createTextNode(rest.slice(0, best.m.index)));
    frag.append(best.rule.make(best.m));
    rest = rest.slice(best.m.index + best.m[0].length);
  }
  return frag;
}

// ---- blocks ---------------------------------------------------------------------------------------------
function codeBlock(lang, lines) {
  const box = el("div", "code-block");
  const bar = el("div", "code-bar");
  bar.append(el("span", "code-lang", lang || "code"));
  const copy = el("button", "copy", "Copy");
  copy.type = "button";
  copy.setAttribute("aria-label", "Copy code");
  const code = el("code", lang ? `language-${lang}` : null, lines.join("\n"));
  bar.append(copy);
  const pre = el("pre");
  pre.append(code);
  box.append(bar, pre);
  return box;
}

function splitRow(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

// ":--" left, ":-:" center, "--:" right, "--" as the page's default.
function alignments(separator) {
  return splitRow(separator).map((c) => (c.endsWith(":") ? (c.startsWith(":") ? "center" : "right")
                                         : c.startsWith(":") ? "left" : ""));
}

function tableRow(line, tag, align) {
  const tr = el("tr");
  for (const [i, cell] of splitRow(line).entries()) {
    const node = el(tag);
    if (align[i]) node.setAttribute("align", align[i]);   // the same markup as marked's; chat.css aligns by it
    node.append(renderInline(cell));
    tr.append(node);
  }
  return tr;
}

function table(header, separator, rows) {
  const align = alignments(separator);
  const t = el("table");
  const head = el("thead");
  head.append(tableRow(header, "th", align));
  const body = el("tbody");
  for (const row of rows) body.append(tableRow(row, "td", align));
  t.append(head, body);
  const scroller = el("div", "table-wrap");
  scroller.append(t);
  return scroller;
}

const indentOf = (line) => line.length - line.trimStart().length;

// The lines of one list item from lines[i] on, its content's indentation removed: lines indented to the item's
// text belong to it (blank lines too, while more of it follows), and so does a paragraph's unindented
// continuation. Returns [lines, next index, whether it holds a blank line outside code].
function itemLines(lines, i) {
  const m = ITEM.exec(lines[i]);
  const column = m[1].length + m[2].length + (m[3].length > 4 ? 1 : m[3].length);
  const body = [m[4]];
  let fence = null;
  let blankInside = false;
  for (i++; i < lines.length; i++) {
    const line = lines[i];
    if (!line.trim()) { body.push(""); continue; }
    const lazy = body[body.length - 1] !== "" && !fence && !isBlockStart(line.trimStart(), lines[i + 1]);
    if (indentOf(line) < column && !lazy) break;
    if (body[body.length - 1] === "" && !fence) blankInside = true;
    const own = indentOf(line) >= column ? line.slice(column) : line.trim();
    const f = FENCE.exec(own);
    if (f) fence = fence ? (f[1][0] === fence[0] && !f[2] ? null : fence) : f[1];
    body.push(own);
  }
  while (body.length > 1 && body[body.length - 1] === "") body.pop();
  return [body, i, blankInside];
}

// One list: each item's lines rendered as blocks of their own, so nested lists, paragraphs and code stay in the
// item. A list with blank lines between or inside its items is loose (its paragraphs keep their margins).
function list(lines, i) {
  const first = ITEM.exec(lines[i]);
  const ordered = /\d/.test(first[2]);
  const kind = first[2].slice(-1);            // "-", "*", "+", "." or ")": another one starts another list
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  let loose = false;
  for (;;) {
    const [body, next, blankInside] = itemLines(lines, i);
    const li = el("li");
    li.append(renderMarkdown(body.join("\n")));
    node.append(li);
    loose ||= blankInside;
    let j = next;
    while (j < lines.length && !lines[j].trim()) j++;
    const m = j < lines.length ? ITEM.exec(lines[j]) : null;
    if (!m || m[2].slice(-1) !== kind || RULE.test(lines[j])) { i = next; break; }
    loose ||= !lines[j - 1].trim();     // a blank line between items
    i = j;
  }
  if (!loose) node.classList.add("tight");
  return [node, i];
}

function isBlockStart(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line)
    || (line.includes("|") && next !== undefined && TABLE_SEP.test(next));
}

export function renderMarkdown(src) {
  const frag = document.createDocumentFragment();
  const lines = src.replace(/\r\n?/g, "\n").replace(/^\t+/gm, (tabs) => "    ".repeat(tabs.length)).split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) { i++; continue; }
    if ((m = FENCE.exec(line))) {
      const body = [];
      i++;
      while (i < lines.length && !(lines[i].trim().startsWith(m[1][0].repeat(m[1].length))
                                  && !lines[i].trim().slice(m[1].length).trim())) body.push(lines[i++]);
      i++;  // the closing fence (or past the end while the answer is still streaming)
      frag.append(codeBlock(m[2], body));
    } else if ((m = HEADING.exec(line))) {
      const h = el(`h${Math.min(m[1].length + 2, 6)}`);  // h3..h6: answers sit below the page's own headings
      h.append(renderInline(m[2]));
      frag.append(h);
      i++;
    } else if (RULE.test(line)) {
      frag.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) { inner.push(m[1]); i++; }
      const q = el("blockquote");
      q.append(renderMarkdown(inner.join("\n")));
      frag.append(q);
    } else if (ITEM.test(line)) {
      const [node, next] = list(lines, i);
      frag.append(node);
      i = next;
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
      const [header, separator] = [line, lines[i + 1]];
      const rows = [];
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(lines[i++]);
      frag.append(table(header, separator, rows));
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && !(para.length && isBlockStart(lines[i], lines[i + 1]))) {
        para.push(lines[i++]);
      }
      const p = el("p");
      p.append(renderInline(para.join("\n")));  // single newlines kept (CSS pre-wrap): models mean them
      frag.append(p);
    }
  }
  return frag;
}

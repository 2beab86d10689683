// Qwen3-VL's answers to "where" questions, drawn on the image: boxes (`bbox_2d` [x1, y1, x2, y2]) and points
// (`point_2d` [x, y]) in 0–1000 coordinates relative to the image, each with an optional `label`, written as
// JSON (often in a ```json fence). Under such an answer a figure shows the image it is about (the chat's latest
// image before the answer; another one can be picked) with the marks over it, placed in percent of the image so
// they follow its displayed size, a switch to hide them and a larger view. Labels come from the model: text only.
import { el } from "./dom.js";

export const FIND_PROMPT = "Locate every <thing> in this image and output bbox_2d coordinates in JSON.";
const MAX_MARKS = 200;
const COLOURS = ["#e11d48", "#2563eb", "#16a34a", "#d97706", "#9333ea", "#0891b2", "#db2777", "#65a30d"];
// One flat JSON object holding a box or a point (the model writes them flat, one per object).
const MARK = /\{[^{}]*?"(?:bbox_2d|point_2d)"[^{}]*\}/g;

const clamp = (v) => Math.min(1000, Math.max(0, v));
const numbers = (a, n) => Array.isArray(a) && a.length === n && a.every(Number.isFinite);

// The marks an answer holds: [{kind: "box", x1, y1, x2, y2, label} | {kind: "point", x, y, label}].
export function findMarks(text) {
  const marks = [];
  for (const [json] of (text || "").matchAll(MARK)) {
    let obj;
    try { obj = JSON.parse(json); } catch { continue; }
    const label = obj.label === undefined || obj.label === null ? "" : String(obj.label).slice(0, 80);
    if (numbers(obj.bbox_2d, 4)) {
      const [a, b, c, d] = obj.bbox_2d.map(clamp);
      marks.push({ kind: "box", x1: Math.min(a, c), y1: Math.min(b, d), x2: Math.max(a, c), y2: Math.max(b, d), label });
    } else if (numbers(obj.point_2d, 2)) {
      const [x, y] = obj.point_2d.map(clamp);
      marks.push({ kind: "point", x, y, label });
    }
    if (marks.length >= MAX_MARKS) break;
  }
  return marks;
}

// The images of the conversation up to `node`, oldest first (the default is the last).
export function imagesBefore(chat, node) {
  const chain = [];
  for (let n = chat.nodes[node.parent]; n && n.id !== "root"; n = chat.nodes[n.parent]) chain.unshift(n);
  return chain.flatMap((n) => n.images || []);
}

const pct = (v) => `${v / 10}%`;

function markElement(mark, colour) {
  const box = el("div", `mark mark-${mark.kind}`);
  box.style.setProperty("--mark", colour);
  if (mark.kind === "box") {
    Object.assign(box.style, { left: pct(mark.x1), top: pct(mark.y1), width: pct(mark.x2 - mark.x1), height: pct(mark.y2 - mark.y1) });
    if (mark.y1 < 60) box.classList.add("label-inside");   // no room for the label above the box
  } else {
    Object.assign(box.style, { left: pct(mark.x), top: pct(mark.y) });
  }
  if (mark.label) box.append(el("span", "mark-label", mark.label));
  box.title = mark.label || (mark.kind === "box" ? "box" : "point");
  return box;
}

// The image with its marks over it, at whatever size the page gives it.
function stageElement(image, marks) {
  const stage = el("div", "ground-stage");
  const img = el("img");
  img.src = image.url;
  img.alt = image.name || "image";
  const layer = el("div", "ground-marks");
  const labels = [...new Set(marks.map((m) => m.label))];
  layer.append(...marks.map((m) => markElement(m, COLOURS[labels.indexOf(m.label) % COLOURS.length])));
  stage.append(img, layer);
  return stage;
}

function zoom(image, marks) {
  const dialog = el("dialog", "ground-zoom");
  dialog.setAttribute("aria-label", `${image.name || "Image"}, enlarged, with the answer's marks`);
  const close = el("button", "ghost icon ground-close", "×");
  close.type = "button";
  close.setAttribute("aria-label", "Close");
  close.addEventListener("click", () => dialog.close());
  dialog.addEventListener("click", (e) => { if (e.target === dialog) dialog.close(); });   // the backdrop
  dialog.addEventListener("close", () => dialog.remove());
  const stage = stageElement(image, marks);
  if (image.width && image.height) {   // as large as the window allows, small images too
    const scale = Math.min((innerWidth * 0.9) / image.width, (innerHeight * 0.84) / image.height);
    Object.assign(stage.querySelector("img").style, { width: `${Math.floor(image.width * scale)}px`,
                                                     height: `${Math.floor(image.height * scale)}px` });
  }
  dialog.append(close, stage);
  document.body.append(dialog);
  dialog.showModal();
}

function summary(marks) {
  const boxes = marks.filter((m) => m.kind === "box").length;
  const points = marks.length - boxes;
  return [boxes && `${boxes} box${boxes === 1 ? "" : "es"}`, points && `${points} point${points === 1 ? "" : "s"}`]
    .filter(Boolean).join(", ");
}

// The figure under an answer holding marks (null when it holds none, or the chat has no image before it).
export function groundingElement(chat, node, choice = null) {
  const marks = findMarks(node.text);
  const images = imagesBefore(chat, node);
  if (!marks.length || !images.length) return null;
  const index = choice ?? images.length - 1;
  const image = images[index];
  const fig = el("figure", "grounding");
  fig.dataset.testid = "grounding";
  const stage = stageElement(image, marks);
  stage.title = "Click for a larger view";
  stage.addEventListener("click", () => zoom(image, marks));
  const toggle = el("button", "ghost small ground-toggle", "Hide marks");
  toggle.type = "button";
  toggle.setAttribute("aria-pressed", "true");
  toggle.addEventListener("click", () => {
    const off = fig.classList.toggle("marks-off");
    toggle.setAttribute("aria-pressed", String(!off));
    toggle.textContent = off ? "Show marks" : "Hide marks";
  });
  const bar = el("figcaption", "ground-bar");
  bar.append(el("span", "ground-summary", `${summary(marks)} on ${image.name || "the image"}`), toggle);
  if (images.length > 1) {
    const pick = el("select", "ground-image");
    pick.setAttribute("aria-label", "The image the marks are on");
    images.forEach((im, i) => pick.append(Object.assign(el("option", null, `Image ${i + 1}: ${im.name || "untitled"}`), { value: String(i) })));
    pick.value = String(index);
    pick.addEventListener("change", () => fig.replaceWith(groundingElement(chat, node, Number(pick.value))));
    bar.append(pick);
  }
  fig.append(stage, bar);
  return fig;
}

// "Find…" on an image of the conversation: onFind(nodeId, index) for the image clicked.
export function handleFind(container, onFind) {
  container.addEventListener("click", (e) => {
    const b = e.target.closest("button.find");
    if (b) onFind(b.dataset.node, Number(b.dataset.index));
  });
}

// Prefills the message box with the grounding question, "<thing>" selected for the user to type over.
export function askToFind(prompt) {
  prompt.value = FIND_PROMPT;
  prompt.focus();
  const at = FIND_PROMPT.indexOf("<thing>");
  prompt.setSelectionRange(at, at + "<thing>".length);
  prompt.dispatchEvent(new Event("input", { bubbles: true }));   // resized, kept as the draft
}

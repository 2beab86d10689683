// PDFs attached as pages: pdf.js (static/vendor/pdfjs, copied there by web/install_vendor.sh; never a CDN)
// renders each page in the browser, the user picks the pages (all by default, up to the images the message may
// still take), and each chosen page goes as one image, as an attached image does.
import { el } from "./dom.js";

const VENDOR = "/static/vendor/pdfjs/";
const PAGE_SIDE = 1280;     // a page's longest side as sent, in pixels (attachments.js sends images at this size)
const THUMB_SIDE = 120;
let library = null;

async function pdfjs() {
  library ??= import(`${VENDOR}pdf.min.mjs`).then((lib) => {
    lib.GlobalWorkerOptions.workerSrc = `${VENDOR}pdf.worker.min.mjs`;
    return lib;
  });
  return library;
}

async function openPdf(file) {
  const lib = await pdfjs();
  // isEvalSupported off: fonts are drawn without compiling code from the file.
  const task = lib.getDocument({ data: new Uint8Array(await file.arrayBuffer()), isEvalSupported: false,
                                 enableXfa: false, cMapUrl: `${VENDOR}cmaps/`, cMapPacked: true,
                                 standardFontDataUrl: `${VENDOR}standard_fonts/`, wasmUrl: `${VENDOR}wasm/`,
                                 iccUrl: `${VENDOR}iccs/` });
  try {
    return await task.promise;
  } catch (err) {
    const why = err?.name === "PasswordException" ? "it is password-protected" : err?.message || "unreadable";
    throw new Error(`“${file.name}” could not be opened as a PDF: ${why}.`);
  }
}

// One page drawn on a white canvas with its longest side `side` pixels.
async function renderPage(doc, number, side) {
  const page = await doc.getPage(number);
  const base = page.getViewport({ scale: 1 });
  const viewport = page.getViewport({ scale: side / Math.max(base.width, base.height) });
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(viewport.width));
  canvas.height = Math.max(1, Math.round(viewport.height));
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  await page.render({ canvasContext: ctx, canvas, viewport }).promise;
  page.cleanup();
  return canvas;
}

function pickerButton(text, className) {
  const b = el("button", className, text);
  b.type = "button";
  return b;
}

// Shows the page picker in `container`; resolves with the chosen page numbers (none: cancelled).
function pickPages(container, doc, name, room) {
  return new Promise((resolve) => {
    const count = doc.numPages;
    const boxes = [];
    const grid = el("div", "pdf-pages");
    for (let n = 1; n <= count; n++) {
      const label = el("label", "pdf-page");
      const box = el("input");
      box.type = "checkbox";
      box.checked = n <= room;
      box.dataset.page = String(n);
      box.setAttribute("aria-label", `Page ${n}`);
      label.append(box, el("span", "pdf-thumb"), el("span", "pdf-page-no", String(n)));
      grid.append(label);
      boxes.push(box);
    }
    const head = el("p", "pdf-head", `${name}: ${count} page${count === 1 ? "" : "s"}`);
    const note = el("p", "note pdf-note");
    const attach = pickerButton("", "primary pdf-attach");
    const all = pickerButton("All", "ghost small");
    const none = pickerButton("None", "ghost small");
    const cancel = pickerButton("Cancel", "ghost");
    const update = () => {
      const picked = boxes.filter((b) => b.checked).length;
      attach.textContent = `Attach ${picked} page${picked === 1 ? "" : "s"}`;
      attach.disabled = picked === 0 || picked > room;
      note.textContent = picked > room ? `Too many pages: this message can take ${room} more image${room === 1 ? "" : "s"}.`
        : count > room ? `This message can take ${room} more image${room === 1 ? "" : "s"}: pick the pages that matter.` : "";
    };
    grid.addEventListener("change", update);
    all.addEventListener("click", () => { boxes.forEach((b, i) => { b.checked = i < room; }); update(); });
    none.addEventListener("click", () => { boxes.forEach((b) => { b.checked = false; }); update(); });
    const done = (pages) => { container.hidden = true; container.replaceChildren(); resolve(pages); };
    attach.addEventListener("click", () => done(boxes.filter((b) => b.checked).map((b) => Number(b.dataset.page))));
    cancel.addEventListener("click", () => done([]));
    const bar = el("div", "pdf-bar");
    bar.append(all, none, el("span", "spacer"), cancel, attach);
    container.replaceChildren(head, grid, note, bar);
    container.hidden = false;
    update();
    drawThumbs(doc, grid, () => container.hidden);
  });
}

// Small renders of the pages, one after another, until the picker closes.
async function drawThumbs(doc, grid, closed) {
  const slots = grid.querySelectorAll(".pdf-thumb");
  for (let n = 1; n <= slots.length && !closed(); n++) {
    try { slots[n - 1].append(await renderPage(doc, n, THUMB_SIDE)); } catch { return; }
  }
}

// The pages of `file` the user picks, as image attachments {url, name, width, height, page}; throws with a
// message when the file cannot be read.
export async function pdfPages(file, { container, room }) {
  const name = file.name || "document.pdf";
  if (room <= 0) throw new Error(`“${name}” was not attached: this message already has as many images as the model takes.`);
  const doc = await openPdf(file);
  try {
    const pages = await pickPages(container, doc, name, room);
    const out = [];
    for (const n of pages) {
      const canvas = await renderPage(doc, n, PAGE_SIDE);
      out.push({ url: canvas.toDataURL("image/jpeg", 0.9), name: `${name} p. ${n}`, width: canvas.width,
                 height: canvas.height, page: n });
    }
    return out;
  } finally {
    doc.loadingTask.destroy();   // its worker too
  }
}

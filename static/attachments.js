// What is attached to the next message, picked by the button, dropped on the page or pasted: images, videos
// (video_attach.js), PDF pages (pdf_attach.js: sent as images) and text files (textfile_attach.js: sent as text).
// An image becomes a data: URL (the engine takes media only inline), downscaled first when large, because a
// phone photo as base64 can exceed the upload limit and the model resizes to far fewer pixels anyway.
import { el, readAsDataURL, removeButton } from "./dom.js";
import { pdfPages } from "./pdf_attach.js";
import { fileChip, fileTokens, isTextFile, readTextFile } from "./textfile_attach.js";
import { VIDEO_DEFAULTS, readVideo, videoCard, videoTokens } from "./video_attach.js";

const MAX_SIDE = 1280;                  // longest side sent to the server, in pixels
const PASSTHROUGH_BYTES = 1_500_000;    // small files in a common format are sent as they are
const PASSTHROUGH_TYPES = new Set(["image/png", "image/jpeg", "image/webp", "image/gif"]);

export async function imageToDataURL(file) {
  let bitmap;
  try {
    bitmap = await createImageBitmap(file);
  } catch {
    throw new Error(`“${file.name || "image"}” could not be read as an image.`);
  }
  const { width, height } = bitmap;
  const scale = Math.min(1, MAX_SIDE / Math.max(width, height));
  if (scale === 1 && file.size <= PASSTHROUGH_BYTES && PASSTHROUGH_TYPES.has(file.type)) {
    bitmap.close();
    return { url: await readAsDataURL(file), width, height };
  }
  const w = Math.max(1, Math.round(width * scale));
  const h = Math.max(1, Math.round(height * scale));
  const canvas = document.createElement("canvas");
  canvas.width = w;
  canvas.height = h;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";  // JPEG has no alpha: put transparent areas on white rather than black
  ctx.fillRect(0, 0, w, h);
  ctx.drawImage(bitmap, 0, 0, w, h);
  bitmap.close();
  return { url: canvas.toDataURL("image/jpeg", 0.9), width: w, height: h };
}

// What kind of attachment a file makes: "image", "video", "pdf", "text", or null (none the page takes).
function kindOf(file) {
  if (file.type.startsWith("image/")) return "image";
  if (file.type.startsWith("video/") || /\.(mp4|m4v|webm|mov|mkv|ogv)$/i.test(file.name || "")) return "video";
  if (file.type === "application/pdf" || /\.pdf$/i.test(file.name || "")) return "pdf";
  return isTextFile(file) ? "text" : null;
}

// Vision tokens of an image the size it is sent at (one per 32×32 pixels): the meter's estimate.
function imageTokens(image) { return Math.max(1, Math.round(image.width / 32)) * Math.max(1, Math.round(image.height / 32)); }

export class Attachments {
  // picker: where a PDF's page picker shows; onChange(): what is attached changed (added, removed, cleared,
  // restored, a video's frames).
  constructor({ container, fileInput, button, note, picker, onError, onChange }) {
    Object.assign(this, { container, fileInput, button, note, picker, onError, onChange });
    this.images = [];
    this.videos = [];
    this.files = [];
    this.media = true;      // the model reads images and video (text files are taken either way)
    this.pdf = false;       // pdf.js is installed (static/vendor/pdfjs)
    this.maxImages = 8;     // the engine's images-per-prompt limit, set from GET /v1/models
    this.maxBytes = 20 << 20;
    this.video = VIDEO_DEFAULTS;
    button.addEventListener("click", () => fileInput.click());
    fileInput.addEventListener("change", () => {
      this.addFiles([...fileInput.files]);
      fileInput.value = "";  // picking the same file again must fire change again
    });
  }

  // Media off (a text-only model): images, videos and PDFs are refused with `reason`; text files still go.
  setEnabled(enabled, reason) {
    this.media = enabled;
    this.note.hidden = enabled;
    this.note.textContent = enabled ? "" : reason;
    this.fileInput.accept = enabled ? "" : "text/*,.md,.csv,.json,.py,.js,.ts,.yaml,.yml,.toml,.log";
    if (!enabled && (this.images.length || this.videos.length)) { this.images = []; this.videos = []; this.render(); }
  }

  async addFiles(files) {
    for (const file of files) {
      const kind = kindOf(file);
      try {
        if (!kind) throw new Error(`“${file.name || "this file"}” cannot be attached: images, videos, PDFs and text files (code, .md, .txt, .csv, .json…) can.`);
        if (kind !== "text" && !this.media) throw new Error(this.note.textContent);
        if (kind === "image") this.addImage(await imageToDataURL(file), file.name || "pasted image");
        else if (kind === "video") this.videos.push(await readVideo(file, { maxBytes: this.maxBytes, limits: this.video }));
        else if (kind === "text") this.files.push(await readTextFile(file));
        else if (!this.pdf) throw new Error("PDFs cannot be attached: pdf.js is not installed (web/install_vendor.sh installs it, with npm).");
        else for (const page of await pdfPages(file, { container: this.picker, room: this.maxImages - this.images.length })) this.addImage(page);
      } catch (err) {
        this.onError(err.message);
      }
      this.render();
    }
  }

  addImage(image, name = image.name) {
    if (this.images.length >= this.maxImages) throw new Error(`At most ${this.maxImages} images per message.`);
    this.images.push({ ...image, name });
  }

  // An image of the conversation attached again (once), for a question about it.
  attachImage(image) {
    try {
      if (!this.images.some((im) => im.url === image.url)) this.addImage(image);
    } catch (err) { this.onError(err.message); }
    this.render();
  }

  // What the next message carries: {images, videos, files}.
  content() { return { images: this.images.slice(), videos: this.videos.slice(), files: this.files.slice() }; }

  count() { return this.images.length + this.videos.length + this.files.length; }

  // Tokens the attachments add to the next prompt, estimated (the engine reports the real count).
  tokens() {
    return this.images.reduce((n, im) => n + imageTokens(im), 0) + this.videos.reduce((n, v) => n + videoTokens(v, this.video), 0)
      + this.files.reduce((n, f) => n + fileTokens(f), 0);
  }

  // Takes {images, videos, files} (a draft or a message given back); a list is images alone (older drafts).
  restore(content) {
    const c = Array.isArray(content) ? { images: content } : content || {};
    this.images = (c.images || []).slice();
    this.videos = (c.videos || []).slice();
    this.files = (c.files || []).slice();
    this.render();
  }

  clear() { this.restore({}); }

  render() {
    const drop = (list, item) => () => { list.splice(list.indexOf(item), 1); this.render(); };
    this.container.replaceChildren(
      ...this.images.map((item) => imageThumb(item, drop(this.images, item))),
      ...this.videos.map((v) => videoCard(v, this.video, { onRemove: drop(this.videos, v), onChange: () => this.onChange?.() })),
      ...this.files.map((f) => fileChip(f, drop(this.files, f))));
    this.container.hidden = this.count() === 0;
    this.onChange?.();
  }
}

function imageThumb(item, onRemove) {
  const box = el("figure", "thumb");
  box.dataset.testid = "thumb";
  const img = el("img");
  img.src = item.url;
  img.alt = item.name;
  const remove = removeButton(item.name, onRemove);
  box.append(img, el("figcaption", null, item.page ? `p. ${item.page}` : `${item.width}×${item.height}`), remove);
  return box;
}

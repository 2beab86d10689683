// Images attached to the next message: picked by the button, dropped on the page or pasted. Each becomes a
// data: URL (the engine takes images only inline), downscaled first when large, because a phone photo as
// base64 can exceed the upload limit and the model resizes to far fewer pixels anyway.

const MAX_SIDE = 1280;                  // longest side sent to the server, in pixels
const PASSTHROUGH_BYTES = 1_500_000;    // small files in a common format are sent as they are
const PASSTHROUGH_TYPES = new Set(["image/png", "image/jpeg", "image/webp", "image/gif"]);

function readAsDataURL(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

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

export class Attachments {
  // onChange(): the list of images changed (added, removed, cleared, restored).
  constructor({ container, fileInput, button, note, onError, onChange }) {
    this.container = container;
    this.fileInput = fileInput;
    this.button = button;
    this.note = note;
    this.onError = onError;
    this.onChange = onChange;
    this.items = [];
    this.enabled = true;
    this.maxImages = 8;     // the engine's images-per-prompt limit, set from GET /v1/models
    button.addEventListener("click", () => fileInput.click());
    fileInput.addEventListener("change", () => {
      this.addFiles([...fileInput.files]);
      fileInput.value = "";  // picking the same file again must fire change again
    });
  }

  setEnabled(enabled, reason) {
    this.enabled = enabled;
    this.button.disabled = !enabled;
    this.note.hidden = enabled;
    this.note.textContent = enabled ? "" : reason;
    if (!enabled && this.items.length) this.clear();
  }

  async addFiles(files) {
    const images = files.filter((f) => f.type.startsWith("image/"));
    if (files.length && !images.length) { this.onError("Only image files can be attached."); return; }
    if (!this.enabled) { this.onError(this.note.textContent); return; }
    for (const file of images) {
      if (this.items.length >= this.maxImages) { this.onError(`At most ${this.maxImages} images per message.`); break; }
      try {
        const img = await imageToDataURL(file);
        this.items.push({ name: file.name || "pasted image", ...img });
      } catch (err) {
        this.onError(err.message);
      }
    }
    this.render();
  }

  list() { return this.items.slice(); }

  restore(items) { this.items = items.slice(); this.render(); }

  clear() { this.items = []; this.render(); }

  render() {
    this.container.replaceChildren(...this.items.map((item, index) => {
      const box = document.createElement("figure");
      box.className = "thumb";
      box.dataset.testid = "thumb";
      const img = document.createElement("img");
      img.src = item.url;
      img.alt = item.name;
      const cap = document.createElement("figcaption");
      cap.textContent = `${item.width}×${item.height}`;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "remove";
      remove.textContent = "×";
      remove.setAttribute("aria-label", `Remove ${item.name}`);
      remove.addEventListener("click", () => { this.items.splice(index, 1); this.render(); });
      box.append(img, cap, remove);
      return box;
    }));
    this.container.hidden = this.items.length === 0;
    this.onChange?.();
  }
}

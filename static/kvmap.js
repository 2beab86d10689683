// The KV block map: every GPU block of the engine's pool as one cell, coloured by the request holding it;
// blocks that are free but still hold a prefix-cache entry in teal, shared prefix blocks outlined, swapped-out
// requests listed with their CPU blocks, and bytes beside every block count. Data: GET /stats/blocks.

const $ = (id) => document.getElementById(id);
const FREE = -1, CACHED = -2;

export function formatBytes(n) {
  if (!Number.isFinite(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n >= 100 || Number.isInteger(n) ? Math.round(n) : n.toFixed(1)} ${units[i]}`;
}

// A stable, distinct colour per request index (golden-angle hues).
function requestColor(k) { return `hsl(${Math.round((k * 137.508 + 250) % 360)} 70% 55%)`; }

function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

export class KVMap {
  constructor() {
    this.canvas = $("kv-map");
    this.box = $("kv-map-box");
    this.data = null;
    document.addEventListener("themechange", () => { if (this.data) this.render(this.data); });
  }

  clear() {
    this.data = null;
    this.box.dataset.state = "none";
    const ctx = this.canvas.getContext("2d");
    ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    $("kv-map-summary").textContent = "—";
    $("kv-requests").replaceChildren();
  }

  async poll() {
    try {
      const resp = await fetch("/stats/blocks", { cache: "no-store" });
      if (resp.ok) this.render(await resp.json());
    } catch { /* the status light tells */ }
  }

  render(map) {
    this.data = map;
    const codes = new Int32Array(map.num_blocks);
    let i = 0;
    for (const [code, count] of map.runs) { codes.fill(code, i, i + count); i += count; }
    const held = codes.reduce((n, c) => n + (c >= 0), 0);
    const cached = codes.reduce((n, c) => n + (c === CACHED), 0);
    const free = map.num_blocks - held - cached;
    Object.assign(this.box.dataset, { state: "live", held: String(held), cached: String(cached), free: String(free),
                                      requests: String(map.requests.filter((r) => r.blocks > 0).length),
                                      swapped: String(map.requests.filter((r) => r.state === "swapped").length) });
    this.draw(codes, map.shared || []);
    const b = map.bytes_per_block;
    $("kv-map-summary").textContent = `held ${held.toLocaleString("en-US")} (${formatBytes(held * b)}) · cached `
      + `${cached.toLocaleString("en-US")} (${formatBytes(cached * b)}) · free ${free.toLocaleString("en-US")} `
      + `(${formatBytes(free * b)}) · ${formatBytes(b)} per block`;
    this.legend(map);
  }

  draw(codes, shared) {
    const n = codes.length;
    const width = this.canvas.clientWidth || 260;
    // Square cells as large as fit in at most 180 px of height; at least 2 px (a 30,000-block pool still fits).
    const cell = Math.max(2, Math.min(14, Math.floor(Math.sqrt((width * 180) / Math.max(1, n)))));
    const cols = Math.max(1, Math.floor(width / cell));
    const rows = Math.ceil(n / cols);
    const dpr = window.devicePixelRatio || 1;
    this.canvas.width = Math.round(cols * cell * dpr);
    this.canvas.height = Math.round(rows * cell * dpr);
    this.canvas.style.height = `${rows * cell}px`;
    Object.assign(this.canvas.dataset, { cell: String(cell), cols: String(cols) });
    const ctx = this.canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    const gap = cell >= 5 ? 1 : 0;
    const colors = { [FREE]: cssVar("--free"), [CACHED]: cssVar("--cached") };
    for (let i = 0; i < n; i++) {
      const c = codes[i];
      ctx.fillStyle = c >= 0 ? requestColor(c) : colors[c];
      ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - gap, cell - gap);
    }
    if (cell >= 5) {
      ctx.strokeStyle = cssVar("--text");
      ctx.lineWidth = 1;
      for (const [start, count] of shared) {
        for (let i = start; i < start + count; i++) {
          ctx.strokeRect((i % cols) * cell + 0.5, Math.floor(i / cols) * cell + 0.5, cell - gap - 1, cell - gap - 1);
        }
      }
    }
    this.canvas.setAttribute("aria-label", `GPU block map: ${n} blocks`);
  }

  legend(map) {
    const b = map.bytes_per_block;
    $("kv-requests").replaceChildren(...map.requests.map((r, k) => {
      const li = document.createElement("li");
      li.dataset.state = r.state;
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = r.state === "swapped" ? "transparent" : requestColor(k);
      if (r.state === "swapped") swatch.classList.add("swapped");
      const name = document.createElement("span");
      name.className = "req-id";
      name.textContent = r.id.replace(/^(chatcmpl|cmpl)-/, "").slice(0, 14);
      name.title = r.id;
      const what = document.createElement("span");
      what.className = "req-blocks";
      what.textContent = r.state === "swapped"
        ? `swapped out · ${r.cpu_blocks} CPU blocks (${formatBytes(r.cpu_blocks * b)})`
        : `${r.state} · ${r.blocks} blocks (${formatBytes(r.blocks * b)})`;
      li.append(swatch, name, what);
      return li;
    }));
  }
}

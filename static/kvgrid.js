// The GPU block pool drawn on a canvas of bounded height, at any pool size. While the blocks fit, one cell is one
// block (shared prefix blocks outlined); past that one cell stands for a range of blocks (a round number of them)
// and takes the colour of the request holding most of its blocks, else teal if a free block in it still holds a
// prefix-cache entry, else the free colour; a cell whose blocks are not all alike is drawn faded. Hovering (or
// tapping) a cell shows its block range and who holds what in it. Input: the run-length encoded codes of
// GET /stats/blocks (engine/kv_map.py): -1 free, -2 free but prefix cached, k >= 0 held by requests[k].

export const FREE = -1, CACHED = -2;
const MAX_HEIGHT = 150;       // CSS px: the map never grows past this, however many blocks
const MAX_CELL = 14, MIN_CELL = 3;
const NICE = [1, 2, 2.5, 5];  // blocks per cell: 1, 2, 2.5, 5 times a power of ten, rounded up to whole blocks

// A stable, distinct colour per request index: golden-angle hues on the circle less the cached blocks' teal.
export function requestColor(k) {
  const hue = (((k * 137.508 + 250) % 360) * 310) / 360;
  return `hsl(${Math.round(hue >= 150 ? hue + 50 : hue)} 70% 55%)`;
}

function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

function niceAtLeast(x) {
  for (let scale = 1; ; scale *= 10) {
    for (const m of NICE) if (Math.ceil(m * scale) >= x) return Math.ceil(m * scale);
  }
}

// Cell size, columns and blocks per cell for n blocks in a width of `width` CSS px.
export function layout(n, width) {
  const colsAt = (cell) => Math.max(1, Math.floor(width / cell));
  let cell = Math.min(MAX_CELL, Math.floor(Math.sqrt((width * MAX_HEIGHT) / Math.max(1, n))));
  while (cell > MIN_CELL && Math.ceil(n / colsAt(cell)) * cell > MAX_HEIGHT) cell--;
  if (cell >= MIN_CELL && Math.ceil(n / colsAt(cell)) * cell <= MAX_HEIGHT) return { cell, cols: colsAt(cell), per: 1 };
  const cols = colsAt(MIN_CELL);
  const per = niceAtLeast(n / (cols * Math.floor(MAX_HEIGHT / MIN_CELL)));
  return { cell: MIN_CELL, cols, per };
}

// The runs as parallel arrays with each run's first block, for walking ranges and looking blocks up.
function indexRuns(runs, n) {
  const codes = new Int32Array(runs.length), starts = new Float64Array(runs.length + 1);
  let at = 0;
  runs.forEach(([code, count], i) => { codes[i] = code; starts[i] = at; at += Math.max(0, count); });
  starts[runs.length] = Math.max(at, n);
  return { codes, starts };
}

// Blocks per code in [from, to), starting the run search at run `i` (returned: where the next range starts).
function tallyRange(index, from, to, i, tally) {
  const { codes, starts } = index;
  while (i < codes.length && starts[i + 1] <= from) i++;
  let j = i;
  while (j < codes.length && starts[j] < to) {
    const n = Math.min(to, starts[j + 1]) - Math.max(from, starts[j]);
    if (n > 0) tally.set(codes[j], (tally.get(codes[j]) || 0) + n);
    j++;
  }
  return i;
}

// The code a cell is drawn in: the request holding most blocks, else cached, else free.
function dominant(tally) {
  let best = null, bestCount = 0;
  for (const [code, count] of tally) if (code >= 0 && count > bestCount) { best = code; bestCount = count; }
  if (best !== null) return best;
  return tally.has(CACHED) ? CACHED : FREE;
}

// CSS colours as packed RGBA pixels (the byte order of a Uint32Array view of ImageData: little-endian ABGR).
class Palette {
  constructor() {
    const probe = document.createElement("canvas");
    probe.width = probe.height = 1;
    this.ctx = probe.getContext("2d", { willReadFrequently: true });
    this.free = this.rgba(cssVar("--free"));
    this.solid = new Map([[FREE, this.free], [CACHED, this.rgba(cssVar("--cached"))]]);
    this.mixed = new Map();
  }

  rgba(css) {
    this.ctx.clearRect(0, 0, 1, 1);
    this.ctx.fillStyle = css;
    this.ctx.fillRect(0, 0, 1, 1);
    return this.ctx.getImageData(0, 0, 1, 1).data;
  }

  pack([r, g, b, a]) { return ((a << 24) | (b << 16) | (g << 8) | r) >>> 0; }

  // A code's colour, or for a mixed cell that colour at 55% over the free colour.
  pixel(code, mixed) {
    const cache = mixed ? this.mixed : this.solid;
    if (!cache.has(code)) {
      if (!this.solid.has(code)) this.solid.set(code, this.rgba(requestColor(code)));
      const c = this.solid.get(code), f = this.free;
      cache.set(code, mixed ? c.map((v, k) => (k === 3 ? 255 : Math.round(0.55 * v + 0.45 * f[k]))) : c);
    }
    return this.pack(cache.get(code));
  }
}

export class KVGrid {
  constructor(canvas, tip, scale) {
    this.canvas = canvas;
    this.tip = tip;
    this.scale = scale;
    this.map = null;
    this.source = null;
    for (const type of ["pointermove", "pointerdown"]) canvas.addEventListener(type, (e) => this.hover(e));
    canvas.addEventListener("pointerleave", () => { this.tip.hidden = true; });
    // A panel shown (a drawer opened) or resized: draw again for the new width.
    new ResizeObserver(() => {
      if (this.source && this.canvas.parentElement.clientWidth !== this.width) this.draw(this.source);
    }).observe(canvas.parentElement);
  }

  clear() {
    this.map = this.source = null;
    this.tip.hidden = true;
    this.canvas.getContext("2d").clearRect(0, 0, this.canvas.width, this.canvas.height);
    this.scale.textContent = "";
  }

  draw(map) {
    this.source = map;
    this.width = this.canvas.parentElement.clientWidth;
    const palette = new Palette();          // reads the theme's colours: before the clock starts
    const t0 = performance.now();
    const n = Math.max(0, map.num_blocks | 0);
    const geo = layout(n, this.width || 260);
    const { cell, cols, per } = geo;
    const cells = Math.ceil(n / per), rows = Math.max(1, Math.ceil(cells / cols));
    const index = indexRuns(map.runs || [], n);
    this.map = { ...geo, n, cells, rows, index, requests: map.requests || [], shared: map.shared || [] };

    // Whole device pixels per cell, so that every cell is drawn alike; the CSS size is that of the cells.
    const dpr = window.devicePixelRatio || 1;
    const px = Math.max(1, Math.round(cell * dpr)), gap = cell >= 5 ? Math.max(1, Math.round(dpr)) : 0;
    this.canvas.width = cols * px;
    this.canvas.height = rows * px;
    Object.assign(this.canvas.style, { width: `${cols * cell}px`, height: `${rows * cell}px` });
    const ctx = this.canvas.getContext("2d");
    const image = ctx.createImageData(cols * px, rows * px);
    const pixels = new Uint32Array(image.data.buffer);
    const tally = new Map();
    for (let c = 0, run = 0; c < cells; c++) {
      tally.clear();
      run = tallyRange(index, c * per, Math.min(n, (c + 1) * per), run, tally);
      const color = palette.pixel(dominant(tally), tally.size > 1);
      const x = (c % cols) * px, y = Math.floor(c / cols) * px;
      for (let row = y; row < y + px - gap; row++) pixels.fill(color, row * cols * px + x, row * cols * px + x + px - gap);
    }
    ctx.putImageData(image, 0, 0);
    if (per === 1 && cell >= 5) this.outlineShared(ctx, dpr, cell, cols);

    this.scale.textContent = per === 1 ? "one cell per block" : `one cell per ${per.toLocaleString("en-US")} blocks`;
    this.canvas.setAttribute("aria-label", `GPU block map: ${n.toLocaleString("en-US")} blocks, `
                             + `${per === 1 ? "one per cell" : `${per.toLocaleString("en-US")} per cell`}`);
    const drawMs = performance.now() - t0;
    Object.assign(this.canvas.dataset, { cell: String(cell), cols: String(cols), per: String(per),
                                         cells: String(cells), drawMs: drawMs.toFixed(2) });
  }

  outlineShared(ctx, dpr, cell, cols) {
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.strokeStyle = cssVar("--text");
    ctx.lineWidth = 1;
    for (const [start, count] of this.map.shared) {
      for (let i = start; i < start + count && i < this.map.n; i++) {
        ctx.strokeRect((i % cols) * cell + 0.5, Math.floor(i / cols) * cell + 0.5, cell - 2, cell - 2);
      }
    }
    ctx.setTransform(1, 0, 0, 1, 0, 0);
  }

  // The cell under the pointer: its block range and what holds the blocks in it.
  hover(e) {
    const m = this.map;
    if (!m) return;
    const rect = this.canvas.getBoundingClientRect();
    const col = Math.floor(((e.clientX - rect.left) * m.cols) / rect.width);
    const row = Math.floor(((e.clientY - rect.top) * m.rows) / rect.height);
    const c = row * m.cols + col;
    if (col < 0 || col >= m.cols || row < 0 || c >= m.cells) { this.tip.hidden = true; return; }
    const from = c * m.per, to = Math.min(m.n, from + m.per);
    this.tip.textContent = this.describe(from, to);
    this.tip.dataset.from = String(from);
    this.tip.dataset.to = String(to);
    this.tip.hidden = false;
    const box = this.tip.offsetParent?.getBoundingClientRect() ?? rect;
    const left = Math.min(Math.max(0, e.clientX - box.left + 10), Math.max(0, box.width - this.tip.offsetWidth));
    this.tip.style.left = `${left}px`;
    this.tip.style.top = `${e.clientY - box.top + 14}px`;
  }

  describe(from, to) {
    const m = this.map, tally = new Map();
    tallyRange(m.index, from, to, 0, tally);
    const f = (x) => x.toLocaleString("en-US");
    const range = to - from === 1 ? `block ${f(from)}` : `blocks ${f(from)}–${f(to - 1)} (${f(to - from)})`;
    const parts = [...tally.entries()].filter(([code]) => code >= 0).sort((a, b) => b[1] - a[1])
      .map(([code, count]) => `${m.requests[code]?.id ?? `request ${code}`} ${f(count)}`);
    if (tally.get(CACHED)) parts.push(`cached ${f(tally.get(CACHED))}`);
    if (tally.get(FREE)) parts.push(`free ${f(tally.get(FREE))}`);
    const shared = m.shared.reduce((s, [start, count]) => s + Math.max(0, Math.min(to, start + count) - Math.max(from, start)), 0);
    if (shared) parts.push(`${f(shared)} shared`);
    return `${range}: ${parts.join(" · ")}`;
  }
}

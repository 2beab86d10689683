// The KV cache panel: every number in it and the block map come from one GET /stats/blocks snapshot (the block
// map of engine/kv_map.py with the engine's counters of that moment), so the legend, the bars, the queues and
// the map never disagree. Held, cached and free are counted from the map's own runs; the throughput is the
// engine's token counters differentiated over its own clock (uptime_s) between snapshots, so it is the rate of
// the last seconds and falls to 0 when nothing runs.

import { CACHED, KVGrid, requestColor } from "./kvgrid.js";

const $ = (id) => document.getElementById(id);
const HISTORY = 60;          // samples of used GPU blocks kept for the sparkline
const RATE_WINDOW_S = 2;     // the throughput is measured over about this many seconds of the engine's clock

export function formatBytes(n) {
  if (!Number.isFinite(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n >= 100 || Number.isInteger(n) ? Math.round(n) : n.toFixed(1)} ${units[i]}`;
}

function fmt(n) {
  return typeof n === "number" && Number.isFinite(n) ? n.toLocaleString("en-US") : "—";
}

function pct(part, whole) {
  return whole > 0 ? Math.max(0, Math.min(100, (100 * part) / whole)) : 0;
}

// Held, cached and free blocks counted from the map's runs: exactly what the map draws.
function countBlocks(map) {
  let held = 0, cached = 0, listed = 0;
  for (const [code, count] of map.runs || []) {
    if (code >= 0) held += count;
    else if (code === CACHED) cached += count;
    listed += count;
  }
  const total = Math.max(map.num_blocks | 0, listed);
  return { total, held, cached, free: total - held - cached };
}

// Tokens per second from monotonically increasing counters sampled against the engine's clock.
class TokenRate {
  constructor() { this.samples = []; }

  reset() { this.samples = []; }

  // {generation, prompt} in tokens/s, or null until two snapshots of one engine run are known.
  add(s) {
    const t = s.uptime_s, gen = s.num_generation_tokens, prompt = s.num_prompt_tokens;
    if (![t, gen, prompt].every(Number.isFinite)) return null;
    const last = this.samples.at(-1);
    if (last && (t < last.t || gen < last.gen)) this.samples = [];       // the engine restarted
    this.samples.push({ t, gen, prompt });
    while (this.samples.length > 2 && this.samples[1].t <= t - RATE_WINDOW_S) this.samples.shift();
    const base = this.samples.length > 1 ? this.samples[0] : null;
    if (!base || t - base.t < 0.05) return null;
    return { generation: (gen - base.gen) / (t - base.t), prompt: (prompt - base.prompt) / (t - base.t) };
  }
}

export class KVMap {
  constructor() {
    this.box = $("kv-map-box");
    this.grid = new KVGrid($("kv-map"), $("kv-map-tip"), $("kv-map-scale"));
    this.rate = new TokenRate();
    this.samples = [];
    this.data = null;
    document.addEventListener("themechange", () => { if (this.data) this.grid.draw(this.data); });
    // A hidden panel (closed, or a phone's drawer) asks the engine for nothing; shown again, it asks at once.
    this.skipped = false;
    new ResizeObserver(() => { if (this.skipped && this.box.checkVisibility()) this.poll(); }).observe(this.box);
  }

  clear() {
    this.data = null;
    this.skipped = false;
    this.box.dataset.state = "none";
    this.grid.clear();
    this.rate.reset();
    this.samples = [];
    $("kv-spark").querySelector("polyline").setAttribute("points", "");
    for (const id of ["kv-used", "kv-free", "kv-cached", "kv-gpu-text", "kv-gpu-bytes", "kv-cpu-text", "kv-block-size",
                      "kv-queues", "kv-hit", "kv-preempt", "kv-throughput", "kv-map-summary"]) $(id).textContent = "—";
    for (const bar of document.querySelectorAll(".kv .bar .seg")) bar.style.width = "0";
    $("kv-requests").replaceChildren();
    this.specDecode(null);
  }

  // One snapshot; true while the engine has work (the caller then polls again soon).
  async poll() {
    this.skipped = !this.box.checkVisibility();
    if (this.skipped) return false;
    try {
      const resp = await fetch("/stats/blocks", { cache: "no-store" });
      if (resp.ok) return this.render(await resp.json());
    } catch { /* the status light tells */ }
    return false;
  }

  render(s) {
    this.data = s;
    const blocks = countBlocks(s);
    const requests = s.requests || [];
    const running = requests.filter((r) => r.state !== "swapped").length;
    const swapped = requests.filter((r) => r.state === "swapped");
    Object.assign(this.box.dataset, { state: "live", blocks: String(blocks.total), held: String(blocks.held),
                                      cached: String(blocks.cached), free: String(blocks.free),
                                      requests: String(requests.filter((r) => r.blocks > 0).length),
                                      swapped: String(swapped.length) });
    this.gpu(s, blocks);
    const cpuUsed = swapped.reduce((n, r) => n + (r.cpu_blocks || 0), 0);
    this.cpu(s.num_total_cpu_blocks, cpuUsed);
    $("kv-block-size").textContent = s.block_size ? `${s.block_size} tokens` : "—";
    $("kv-queues").textContent = `${fmt(running)} / ${fmt(s.num_waiting)} / ${fmt(swapped.length)}`;
    const hit = s.prefix_cache_hit_rate;
    $("kv-hit").textContent = typeof hit === "number" ? `${(100 * hit).toFixed(1)}%` : "—";
    $("kv-preempt").textContent = `${fmt(s.num_preemptions)} / ${fmt(s.num_swaps)}`;
    const rate = this.rate.add(s);
    const tput = $("kv-throughput");
    tput.textContent = rate ? `generation ${rate.generation.toFixed(1)} tok/s\nprompt ${rate.prompt.toFixed(1)} tok/s` : "—";
    tput.dataset.generation = rate ? rate.generation.toFixed(2) : "";
    this.specDecode(s.spec_decode);
    this.grid.draw(s);
    this.legend(s);
    return running + swapped.length + (s.num_waiting || 0) > 0 || (rate !== null && rate.generation + rate.prompt > 0);
  }

  // Speculative decoding's draft acceptance since the engine started (/stats' spec_decode); the row shows only
  // once the engine has verified a draft.
  specDecode(spec) {
    const shown = Number.isFinite(spec?.acceptance_rate) && Number.isFinite(spec?.mean_acceptance_length)
      && spec.num_drafts > 0;
    $("kv-spec-label").hidden = !shown;
    $("kv-spec").hidden = !shown;
    if (!shown) { $("kv-spec").textContent = "—"; return; }
    const method = typeof spec.method === "string" ? `, ${spec.method}` : "";
    const mean = spec.mean_acceptance_length.toFixed(1);
    $("kv-spec").textContent = `${(100 * spec.acceptance_rate).toFixed(0)}% (mean ${mean} tokens/step${method})`;
  }

  gpu(s, { total, held, cached, free }) {
    const b = s.bytes_per_block;
    $("kv-used").textContent = fmt(held);
    $("kv-free").textContent = fmt(free);
    $("kv-cached").textContent = fmt(cached);
    $("kv-gpu-text").textContent = `${fmt(held)} / ${fmt(total)}`;
    $("kv-gpu-bar").querySelector(".used").style.width = `${pct(held, total)}%`;
    $("kv-gpu-bar").querySelector(".cached").style.width = `${pct(cached, total)}%`;
    $("kv-gpu-bar").setAttribute("aria-label", `${fmt(held)} of ${fmt(total)} GPU blocks used, ${fmt(cached)} cached`);
    $("kv-gpu-bytes").textContent = Number.isFinite(b)
      ? `${formatBytes(held * b)} used of ${formatBytes(total * b)} (${formatBytes(b)} per block)` : "—";
    $("kv-map-summary").textContent = `held ${fmt(held)} (${formatBytes(held * b)}) · cached ${fmt(cached)} `
      + `(${formatBytes(cached * b)}) · free ${fmt(free)} (${formatBytes(free * b)}) · ${formatBytes(b)} per block`;
    if (total > 0) {
      this.samples.push(held / total);
      if (this.samples.length > HISTORY) this.samples.shift();
      const step = 120 / (HISTORY - 1);
      const points = this.samples.map((v, i) => `${(i + HISTORY - this.samples.length) * step},${28 - v * 26 - 1}`);
      $("kv-spark").querySelector("polyline").setAttribute("points", points.join(" "));
    }
  }

  cpu(total, used) {
    $("kv-cpu-text").textContent = total ? `${fmt(used)} / ${fmt(total)}` : "off (no --swap-space)";
    $("kv-cpu-bar").querySelector(".swap").style.width = `${pct(used, total)}%`;
    $("kv-cpu-bar").setAttribute("aria-label", `${fmt(used)} of ${fmt(total)} CPU swap blocks used`);
  }

  legend(map) {
    const b = map.bytes_per_block;
    $("kv-requests").replaceChildren(...(map.requests || []).map((r, k) => {
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
        ? `swapped out · ${fmt(r.cpu_blocks)} CPU blocks (${formatBytes(r.cpu_blocks * b)})`
        : `${r.state} · ${fmt(r.blocks)} blocks (${formatBytes(r.blocks * b)})`;
      li.append(swatch, name, what);
      return li;
    }));
  }
}

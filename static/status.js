// The server status light, the model name, the demo banner and the live KV block pool view.
// The proxy answers /api/status (is the engine ready, or loading, or down?) and forwards /v1/models and /stats from the engine.

import { formatBytes } from "./kvmap.js";

const $ = (id) => document.getElementById(id);
const HISTORY = 60;  // samples of used GPU blocks kept for the sparkline

const LABELS = {
  ready: "Ready",
  starting: "Loading model…",
  restarting: "Engine restarting…",
  failed: "Engine stopped",
  unreachable: "Engine not reachable",
  unresponsive: "Engine not responding",
  offline: "Server offline",
  unknown: "Connecting…",
};

function fmt(n) {
  return typeof n === "number" && Number.isFinite(n) ? n.toLocaleString("en-US") : "—";
}

function pct(part, whole) {
  return whole > 0 ? Math.max(0, Math.min(100, (100 * part) / whole)) : 0;
}

// States in which a message cannot be answered (the page does not send, and stops waiting for an answer).
export const DOWN_STATES = new Set(["starting", "restarting", "failed", "unreachable", "unresponsive", "offline"]);

export class StatusMonitor {
  // onModel(card): the engine is ready and serves this model (GET /v1/models card); onDown(): it stopped;
  // onState(state): after every health answer (downStreak: how many answers in a row said "down").
  constructor({ onModel, onCapabilities, onDown, onStats, onState }) {
    this.onModel = onModel;
    this.onState = onState;
    this.onStats = onStats;
    this.onCapabilities = onCapabilities;
    this.onDown = onDown;
    this.state = "unknown";
    this.detail = "";
    this.model = null;
    this.busy = false;
    this.samples = [];
    this.bannerDismissed = false;
  }

  start() {
    $("demo-banner").querySelector(".dismiss").addEventListener("click", () => {
      this.bannerDismissed = true;  // until the page is reloaded
      $("demo-banner").hidden = true;
    });
    this.pollHealth();
    this.pollStats();
  }

  // Faster stats while an answer streams, so the block pool visibly fills and drains.
  setBusy(busy) {
    this.busy = busy;
    clearTimeout(this.statsTimer);
    this.pollStats();     // at once: the pool visibly fills when an answer starts and empties when it ends
  }

  setState(state, detail, progress) {
    const was = this.state;
    this.state = state;
    const box = $("status");
    box.dataset.state = state;
    const pctText = typeof progress === "number" ? ` ${Math.floor(100 * Math.max(0, Math.min(1, progress)))}%` : "";
    this.detail = detail || "";
    const showsProgress = state === "starting" || state === "restarting";
    box.querySelector(".status-text").textContent = (LABELS[state] || state) + (showsProgress ? pctText : "");
    box.dataset.progress = pctText.trim();
    box.title = detail || "";
    if (state !== "ready" && (was === "ready" || was === "unknown")) this.down();
    if (state === "ready" && was !== "ready") { clearTimeout(this.statsTimer); this.pollStats(); }
  }

  // While the engine is away nothing it reported before is true any more: clear the model and the numbers.
  down() {
    this.model = null;
    $("model-name").textContent = "—";
    this.samples = [];
    $("kv-spark").querySelector("polyline").setAttribute("points", "");
    for (const id of ["kv-used", "kv-free", "kv-cached", "kv-gpu-text", "kv-gpu-bytes", "kv-cpu-text", "kv-block-size", "kv-queues",
                      "kv-hit", "kv-preempt", "kv-throughput"]) $(id).textContent = "—";
    for (const bar of document.querySelectorAll(".kv .bar .seg")) bar.style.width = "0";
    this.onDown?.();
  }

  async pollHealth() {
    try {
      const resp = await fetch("/api/status", { cache: "no-store" });
      const body = await resp.json();
      const state = body.engine || "unreachable";
      this.setState(state, body.error?.message || body.phase, body.progress);
      if (state === "ready" && !this.model) await this.loadModel();
    } catch {
      this.setState("offline", "The chat server (proxy) does not answer.");
    }
    clearTimeout(this.healthTimer);
    this.healthTimer = setTimeout(() => this.pollHealth(), this.state === "ready" ? 4000 : 1500);
    this.downStreak = DOWN_STATES.has(this.state) ? (this.downStreak || 0) + 1 : 0;
    this.onState?.(this.state);
    return this.state;
  }

  // A health check now (after a failed request: is it the server, or was it the connection?); the new state.
  check() { return this.pollHealth(); }

  // A sentence for the user on why a message cannot be sent or answered now; "" when ready.
  reason() {
    if (!DOWN_STATES.has(this.state)) return "";
    const text = $("status").querySelector(".status-text").textContent;
    const why = {
      starting: "the model is still loading",
      restarting: "the engine is restarting",
      failed: "the engine has stopped",
      unreachable: "the engine is not reachable",
      unresponsive: "the engine does not respond",
      offline: "the chat server does not answer",
    }[this.state];
    return `Not sent: ${why} (${text}). Your message stays in the box; send it once the status says Ready.`;
  }

  async loadModel() {
    try {
      const resp = await fetch("/v1/models", { cache: "no-store" });
      const body = await resp.json();
      const card = body?.data?.[0];
      if (resp.ok && card?.id) {
        this.model = card.id;
        $("model-name").textContent = card.id;
        this.onModel(card);
      }
    } catch { /* the next health poll retries */ }
  }

  async pollStats() {
    clearTimeout(this.statsTimer);
    if (this.state !== "ready") { this.statsTimer = setTimeout(() => this.pollStats(), 2500); return; }
    try {
      const resp = await fetch("/stats", { cache: "no-store" });
      if (resp.ok && this.state === "ready") {
        this.renderStats(await resp.json());
        await this.onStats?.();
      }
    } catch { /* shown by the health light */ }
    clearTimeout(this.statsTimer);
    this.statsTimer = setTimeout(() => this.pollStats(), this.busy ? 700 : 2500);
  }

  renderStats(s) {
    const banner = $("demo-banner");
    banner.hidden = s.demo_model !== true || this.bannerDismissed;
    if (s.demo_model === true && s.model) banner.querySelector(".demo-name").textContent = s.model;
    // A missing `multimodal` field means an engine that does not say: let the user try.
    this.onCapabilities({ multimodal: s.multimodal !== false, demo: s.demo_model === true });

    const total = s.num_total_gpu_blocks;
    const used = s.num_used_gpu_blocks ?? (total - s.num_free_gpu_blocks);
    $("kv-used").textContent = fmt(used);
    $("kv-free").textContent = fmt(s.num_free_gpu_blocks);
    $("kv-cached").textContent = fmt(s.num_cached_blocks);
    $("kv-gpu-text").textContent = `${fmt(used)} / ${fmt(total)}`;
    $("kv-gpu-bar").querySelector(".used").style.width = `${pct(used, total)}%`;
    $("kv-gpu-bar").setAttribute("aria-label", `${fmt(used)} of ${fmt(total)} GPU blocks used`);
    const bpb = s.bytes_per_block;
    $("kv-gpu-bytes").textContent = Number.isFinite(bpb)
      ? `${formatBytes(used * bpb)} used of ${formatBytes(total * bpb)} (${formatBytes(bpb)} per block)` : "—";

    const cpuTotal = s.num_total_cpu_blocks;
    const cpuUsed = cpuTotal - s.num_free_cpu_blocks;
    $("kv-cpu-text").textContent = cpuTotal ? `${fmt(cpuUsed)} / ${fmt(cpuTotal)}` : "off (no --swap-space)";
    $("kv-cpu-bar").querySelector(".swap").style.width = `${pct(cpuUsed, cpuTotal)}%`;
    $("kv-cpu-bar").setAttribute("aria-label", `${fmt(cpuUsed)} of ${fmt(cpuTotal)} CPU swap blocks used`);

    $("kv-block-size").textContent = s.block_size ? `${s.block_size} tokens` : "—";
    $("kv-queues").textContent = `${fmt(s.num_running)} / ${fmt(s.num_waiting)} / ${fmt(s.num_swapped)}`;
    const hit = s.prefix_cache_hit_rate;
    $("kv-hit").textContent = typeof hit === "number" ? `${(100 * hit).toFixed(1)}%` : "—";
    $("kv-preempt").textContent = `${fmt(s.num_preemptions)} / ${fmt(s.num_swaps)}`;
    $("kv-throughput").textContent = throughputText(s);

    if (Number.isFinite(used) && total > 0) {
      this.samples.push(used / total);
      if (this.samples.length > HISTORY) this.samples.shift();
      const step = 120 / (HISTORY - 1);
      const points = this.samples.map((v, i) => `${(i + HISTORY - this.samples.length) * step},${28 - v * 26 - 1}`);
      $("kv-spark").querySelector("polyline").setAttribute("points", points.join(" "));
    }
  }
}

// Every *throughput* field the engine reports, e.g. avg_generation_throughput -> "generation 31.2 tok/s".
function throughputText(s) {
  const parts = Object.entries(s)
    .filter(([k, v]) => k.includes("throughput") && typeof v === "number")
    .map(([k, v]) => `${k.replace(/^avg_|_throughput.*$/g, "").replace(/_/g, " ")} ${v.toFixed(1)} tok/s`);
  return parts.length ? parts.join("\n") : "—";
}

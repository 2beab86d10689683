// The server status light, the model name and the demo banner; the pace of the KV panel's polling (kvmap.js).
// The proxy answers /api/status (is the engine ready, or loading, or down?) and forwards /v1/models and /stats from the engine.

const $ = (id) => document.getElementById(id);

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

// "2.1 of 5.0 GB" (MB below a GB), as the terminal says it (app/hub.py).
const sizes = (done, total) => {
  const [scale, unit] = total >= 1e9 ? [1e9, "GB"] : [1e6, "MB"];
  return `${(done / scale).toFixed(1)} of ${(total / scale).toFixed(1)} ${unit}`;
};

// States in which a message cannot be answered (the page does not send, and stops waiting for an answer).
export const DOWN_STATES = new Set(["starting", "restarting", "failed", "unreachable", "unresponsive", "offline"]);

export class StatusMonitor {
  // onModel(card): the engine is ready and serves this model (GET /v1/models card); onDown(): it stopped;
  // onStats(): after each /stats, the KV panel's own snapshot; it answers true while the engine has work;
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

  // Faster stats while an answer streams or the engine has work, so the block pool visibly fills and drains.
  setBusy(busy) {
    this.busy = busy;
    clearTimeout(this.statsTimer);
    this.pollStats();     // at once: the pool visibly fills when an answer starts and empties when it ends
  }

  // download: {downloaded_bytes, total_bytes} while the launcher fetches the model from the Hub.
  setState(state, detail, progress, download) {
    const was = this.state;
    this.state = state;
    const box = $("status");
    box.dataset.state = state;
    const pctText = typeof progress === "number" ? ` ${Math.floor(100 * Math.max(0, Math.min(1, progress)))}%` : "";
    this.detail = detail || "";
    const showsProgress = state === "starting" || state === "restarting";
    const label = state === "starting" && download ? "Downloading model…" : (LABELS[state] || state);
    const amount = state === "starting" && download ? `, ${sizes(download.downloaded_bytes, download.total_bytes)}` : "";
    box.querySelector(".status-text").textContent = label + (showsProgress ? pctText + amount : "");
    box.dataset.progress = pctText.trim();
    box.title = detail || "";
    if (state !== "ready" && (was === "ready" || was === "unknown")) this.down();
    if (state === "ready" && was !== "ready") { clearTimeout(this.statsTimer); this.pollStats(); }
  }

  // While the engine is away nothing it reported before is true any more: clear the model (onDown: the numbers).
  down() {
    this.model = null;
    $("model-name").textContent = "—";
    this.onDown?.();
  }

  async pollHealth() {
    try {
      const resp = await fetch("/api/status", { cache: "no-store" });
      const body = await resp.json();
      const state = body.engine || "unreachable";
      const download = typeof body.total_bytes === "number" ? body : null;
      this.setState(state, body.error?.message || body.phase, body.progress, download);
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
    let active = false;
    try {
      const resp = await fetch("/stats", { cache: "no-store" });
      if (resp.ok && this.state === "ready") {
        this.renderStats(await resp.json());
        active = (await this.onStats?.()) === true;
      }
    } catch { /* shown by the health light */ }
    clearTimeout(this.statsTimer);
    this.statsTimer = setTimeout(() => this.pollStats(), this.busy || active ? 700 : 2500);
  }

  renderStats(s) {
    const banner = $("demo-banner");
    banner.hidden = s.demo_model !== true || this.bannerDismissed;
    if (s.demo_model === true && s.model) banner.querySelector(".demo-name").textContent = s.model;
    // A missing `multimodal` field means an engine that does not say: let the user try.
    this.onCapabilities({ multimodal: s.multimodal !== false, demo: s.demo_model === true });
  }
}

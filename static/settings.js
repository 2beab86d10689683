// The generation settings: every sampling field the engine takes, checked in the form (a value outside its
// range is marked and nothing is sent), the model's own defaults shown as placeholders, presets, and all of it
// kept in localStorage. An empty field is left out of the request: the server's default applies.

const $ = (id) => document.getElementById(id);

// id -> [request field, kind, min, max, label]; bounds as the engine checks them (temperature kept to 0–2 here)
export const FIELDS = {
  "temperature": ["temperature", "float", 0, 2, "Temperature"],
  "top-p": ["top_p", "float", 0.01, 1, "Top P"],
  "top-k": ["top_k", "int", 0, 1_000_000, "Top K"],
  "min-p": ["min_p", "float", 0, 1, "Min P"],
  "repetition-penalty": ["repetition_penalty", "float", 0.01, 2, "Repetition penalty"],
  "presence-penalty": ["presence_penalty", "float", -2, 2, "Presence penalty"],
  "frequency-penalty": ["frequency_penalty", "float", -2, 2, "Frequency penalty"],
  "seed": ["seed", "int", -(2 ** 53) + 1, 2 ** 53 - 1, "Seed"],
  "max-tokens": ["max_tokens", "int", 1, 1_000_000, "Max tokens"],
};

export const PRESETS = {
  "defaults": { label: "Model defaults", values: {} },
  "precise": { label: "Precise", values: { "temperature": "0.2", "top-p": "0.9" } },
  "balanced": { label: "Balanced", values: { "temperature": "0.7", "top-p": "0.95", "top-k": "40" } },
  "creative": { label: "Creative", values: { "temperature": "1.1", "top-p": "1", "min-p": "0.05" } },
};

// What an empty field means where the model has no default of its own; the markup starts with the same words.
const UNSET = { "seed": "random", "max-tokens": "fit to context" };

const STORED = [...Object.keys(FIELDS), "system-prompt", "stop-strings", "earlier-images"];

function check(id) {
  const input = $(id);
  const [, kind, min, max, label] = FIELDS[id];
  const raw = input.value.trim();
  let problem = "";
  if (raw) {
    const value = Number(raw);
    if (!Number.isFinite(value)) problem = `${label} must be a number.`;
    else if (kind === "int" && !Number.isInteger(value)) problem = `${label} must be a whole number.`;
    else if (value < min || value > max) problem = `${label} must be between ${min} and ${max}.`;
    else if (id === "top-p" && value <= 0) problem = "Top P must be above 0.";
  }
  input.setAttribute("aria-invalid", String(Boolean(problem)));
  input.title = problem;
  return problem;
}

export class Settings {
  constructor({ onChange }) {
    this.onChange = onChange;
    this.details = $("settings");
    this.problemEl = $("settings-problem");
    for (const id of STORED) {
      const input = $(id);
      const saved = localStorage.getItem(`localchat.${id}`);
      if (saved !== null) input.value = saved;
      input.addEventListener("input", () => { if (FIELDS[id]) this.validate(); });
      input.addEventListener("change", () => { localStorage.setItem(`localchat.${id}`, input.value); this.onChange?.(); });
    }
    const presets = $("preset");
    for (const [key, preset] of Object.entries(PRESETS)) presets.append(new Option(preset.label, key));
    presets.addEventListener("change", () => { if (presets.value) this.applyPreset(presets.value); presets.value = ""; });
    $("reset-settings").addEventListener("click", () => this.applyPreset("defaults"));
  }

  applyPreset(key) {
    for (const id of Object.keys(FIELDS)) {
      if (id === "max-tokens") continue;     // a preset is about sampling, not length
      $(id).value = PRESETS[key].values[id] ?? "";
      localStorage.setItem(`localchat.${id}`, $(id).value);
    }
    this.validate();
    this.onChange?.();
  }

  // The model's generation defaults (GET /v1/models: sampling_defaults) as the empty fields' placeholders.
  showDefaults(defaults) {
    for (const [id, [field]] of Object.entries(FIELDS)) {
      const value = defaults?.[field];
      $(id).placeholder = value === undefined || value === null ? (UNSET[id] ?? "default") : `model: ${value}`;
    }
  }

  validate() {
    const problems = Object.keys(FIELDS).map(check).filter(Boolean);
    this.problemEl.textContent = problems.join(" ");
    this.problemEl.hidden = !problems.length;
    return problems;
  }

  // The fields for the request body, or throws with what to fix (the settings open at the bad field).
  requestFields() {
    const problems = this.validate();
    if (problems.length) {
      this.details.open = true;
      this.details.querySelector("[aria-invalid=true]")?.focus();
      throw new Error(`Check the settings: ${problems.join(" ")}`);
    }
    const out = {};
    for (const [id, [field, kind]] of Object.entries(FIELDS)) {
      const raw = $(id).value.trim();
      if (raw) out[field] = kind === "int" ? parseInt(raw, 10) : parseFloat(raw);
    }
    const stop = $("stop-strings").value.split("\n").map((s) => s.replace(/\\n/g, "\n")).filter((s) => s.length);
    if (stop.length) out.stop = stop.slice(0, 16);
    return out;
  }

  get system() { return $("system-prompt").value.trim(); }

  get keepEarlierImages() { return $("earlier-images").value !== "none"; }
}

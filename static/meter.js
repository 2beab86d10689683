// The context meter beside Send: prompt and answer tokens of the last answer on screen, of the model's context.
// Streaming and stopped answers count: the engine reports running counts with every chunk
// (stream_options.continuous_usage_stats), kept in the answer's meta as they come.

export function showContextMeter(meter, path, maxModelLen) {
  const last = [...path].reverse().find((n) => n.role === "assistant" && n.meta?.promptTokens);
  const used = last ? last.meta.promptTokens + (last.meta.tokens || 0) : 0;
  meter.hidden = !maxModelLen;
  if (!maxModelLen) return;
  meter.querySelector(".meter-text").textContent =
    `Context ${used.toLocaleString("en-US")} / ${maxModelLen.toLocaleString("en-US")} tokens`;
  meter.querySelector(".meter-fill").style.width = `${Math.min(100, (100 * used) / maxModelLen)}%`;
  meter.dataset.used = String(used);
  meter.classList.toggle("full", used / maxModelLen > 0.9);
}

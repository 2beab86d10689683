// The context meter beside Send: prompt and answer tokens of the last answer on screen, of the model's context,
// and what the composer's attachments will add (`pending`: estimated, text files, images and video frames).
// Streaming and stopped answers count: the engine reports running counts with every chunk
// (stream_options.continuous_usage_stats), kept in the answer's meta as they come.

export function showContextMeter(meter, path, maxModelLen, pending = 0) {
  const last = [...path].reverse().find((n) => n.role === "assistant" && n.meta?.promptTokens);
  const used = last ? last.meta.promptTokens + (last.meta.tokens || 0) : 0;
  meter.hidden = !maxModelLen;
  if (!maxModelLen) return;
  const fmt = (n) => n.toLocaleString("en-US");
  meter.querySelector(".meter-text").textContent = pending
    ? `Context ${fmt(used)} +≈${fmt(pending)} / ${fmt(maxModelLen)} tokens`
    : `Context ${fmt(used)} / ${fmt(maxModelLen)} tokens`;
  meter.querySelector(".meter-fill").style.width = `${Math.min(100, (100 * used) / maxModelLen)}%`;
  meter.querySelector(".meter-pending").style.width = `${Math.min(100, (100 * pending) / maxModelLen)}%`;
  meter.dataset.used = String(used);
  meter.dataset.pending = String(pending);
  meter.title = `Prompt and answer tokens of the last turn${pending ? ", plus about what the attachments add" : ""}, of the model's context`;
  meter.classList.toggle("full", (used + pending) / maxModelLen > 0.9);
}

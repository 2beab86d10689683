// A Thinking model's reasoning (the engine's reasoning_content, with --reasoning-parser) above its answer, in a
// collapsed block: "Thinking…" while the thoughts stream, "Thought for N s" once the answer has begun. The
// thoughts are plain text (textContent), never parsed as HTML or Markdown.
import { el } from "./dom.js";

export function thoughtLabel(node, streaming) {
  const ms = node.meta?.thoughtMs;
  if (Number.isFinite(ms)) return `Thought for ${Math.max(1, Math.round(ms / 1000))} s`;
  return streaming ? "Thinking…" : "Thoughts";
}

// The block of `node` in its message `box`: made, updated or removed to match node.reasoning.
export function showReasoning(box, node, streaming = false) {
  let block = box.querySelector(":scope > .thought");
  if (!node.reasoning) {
    block?.remove();
    return;
  }
  if (!block) {
    block = el("details", "thought");
    block.append(el("summary", "thought-summary"), el("div", "thought-text"));
    box.querySelector(":scope > .content").before(block);
  }
  block.classList.toggle("streaming", streaming && !Number.isFinite(node.meta?.thoughtMs));
  block.querySelector(".thought-summary").textContent = thoughtLabel(node, streaming);
  const text = block.querySelector(".thought-text");
  if (text.textContent !== node.reasoning) text.textContent = node.reasoning;
}

// Server-sent events read from a fetch() body. EventSource cannot POST, so the chat reads the stream itself:
// events are separated by a blank line, and only their `data:` lines matter for the OpenAI protocol. Comment
// lines (`: queued 3 ahead`, the engine's word on a request waiting for a slot) go to `onComment`, as text.

export async function* readSSE(body, onComment = () => {}) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let finished = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) { finished = true; break; }
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of block.split("\n")) if (line.startsWith(":")) onComment(line.slice(1).trim());
        const data = block.split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  } finally {
    // The consumer stopped early ([DONE], an error event, Stop): close the connection instead of draining it.
    if (!finished) reader.cancel().catch(() => {});
  }
}

// Server-sent events read from a fetch() body. EventSource cannot POST, so the chat reads the stream itself:
// events are separated by a blank line, and only their `data:` lines matter for the OpenAI protocol.

export async function* readSSE(body) {
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

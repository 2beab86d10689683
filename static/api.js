// The page's requests to the proxy that are more than a fetch: the chat POST (errors read from OpenAI-shaped
// bodies, a max_tokens that does not fit lowered once) and the page config.

class HttpError extends Error {
  constructor(status, body, message) { super(message); this.status = status; this.body = body; }
}

export async function httpError(resp) {
  let body = null;
  try { body = await resp.json(); } catch { /* not JSON: the status line says it */ }
  const message = body?.error?.message || (typeof body?.detail === "string" ? body.detail : "");
  return new HttpError(resp.status, body, `Error ${resp.status}: ${message || resp.statusText || "request failed"}`);
}

// POSTs the chat; a max_tokens that does not fit what is left of the context is lowered to fit, once.
export async function postChat(body, controller, node) {
  const post = () => fetch("/v1/chat/completions", { method: "POST", headers: { "Content-Type": "application/json" },
                                                      body: JSON.stringify(body), signal: controller.signal });
  let resp = await post();
  if (!resp.ok) {
    const err = await httpError(resp);
    const room = /at most (\d+)/.exec(err.body?.error?.message || "");
    if (err.body?.error?.param === "max_tokens" && room && Number(room[1]) > 0 && body.max_tokens) {
      node.meta.note = `max tokens lowered from ${body.max_tokens} to ${room[1]}, the room left in the context`;
      body.max_tokens = Number(room[1]);
      resp = await post();
      if (!resp.ok) throw await httpError(resp);
    } else throw err;
  }
  return resp;
}

export async function loadPageConfig() {
  try {
    const resp = await fetch("/api/page-config", { cache: "no-store" });
    return await resp.json();
  } catch {
    return { vendor: [] };
  }
}

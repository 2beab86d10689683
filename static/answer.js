// One streamed answer read into its message node: the text as it arrives (onText after each delta), a Thinking
// model's reasoning before it (node.reasoning, and how long it thought: meta.thoughtMs), the usage and finish
// reason the engine reports, and the timings the message shows (time to first token, tokens per second).
// While the request waits for a free slot, the engine says how many wait ahead (`: queued N ahead`): onQueued(N).
import { postChat } from "./api.js";
import { readSSE } from "./sse.js";

// An answer's speed is measured only over a stream that lasts this long: chunks that arrive together (a
// buffering network, a short answer) would otherwise give absurd rates.
const MIN_RATE_SPAN_MS = 250;
const QUEUED = /^queued (\d+) ahead$/;

export class AnswerStream {
  constructor(node, onText, onQueued = () => {}) {
    this.node = node;
    this.onText = onText;
    this.onQueued = onQueued;
    this.t0 = performance.now();
    this.chunks = 0;
    this.tFirst = null;
    this.tLast = null;
    this.usage = null;
    this.finish = null;
    this.tThought = null;     // when the first reasoning arrived
  }

  // Reads the answer to `body` until [DONE]; throws on an error event or a stream that ends without [DONE].
  async read(body, controller) {
    const resp = await postChat(body, controller, this.node);
    const onComment = (text) => {
      const queued = QUEUED.exec(text);
      if (queued && this.tFirst === null) this.onQueued(Number(queued[1]));
    };
    for await (const data of readSSE(resp.body, onComment)) {
      if (data === "[DONE]") return;
      let event;
      try { event = JSON.parse(data); } catch { continue; }
      if (event.error) throw new Error(`The engine reported an error: ${event.error.message || "unknown error"}`);
      if (event.usage) this.onUsage(event.usage);
      const choice = event.choices?.[0];
      const thought = choice?.delta?.reasoning_content;
      if (thought) this.onReasoning(thought);
      const delta = choice?.delta?.content;
      if (delta) this.onDelta(delta);
      if (choice?.finish_reason) this.finish = choice.finish_reason;
    }
    throw new Error("The answer stream ended unexpectedly (the server closed the connection).");
  }

  onUsage(usage) {
    this.usage = usage;
    this.node.meta.promptTokens = usage.prompt_tokens ?? null;
    this.node.meta.tokens = usage.completion_tokens ?? this.node.meta.tokens;
  }

  onReasoning(delta) {
    const now = performance.now();
    if (this.tThought === null) this.tThought = now;
    if (this.tFirst === null) this.tFirst = now;
    this.tLast = now;
    this.chunks += 1;
    this.node.reasoning = (this.node.reasoning || "") + delta;
    this.onText(this.chunks);
  }

  // The thinking ends where the answer begins (or where the stream ends, for an answer cut inside it).
  endThought(now) {
    if (this.tThought !== null && !Number.isFinite(this.node.meta.thoughtMs)) {
      this.node.meta.thoughtMs = Math.round(now - this.tThought);
    }
  }

  onDelta(delta) {
    const now = performance.now();
    this.endThought(now);
    if (this.tFirst === null) this.tFirst = now;
    this.tLast = now;
    this.chunks += 1;
    this.node.text += delta;
    this.onText(this.chunks);
  }

  // What the finished message shows: `earlierTokens` are those of the text a continued answer started from.
  meta(earlierTokens) {
    const { tFirst, tLast, usage } = this;
    if (tLast !== null) this.endThought(tLast);
    const tokens = usage?.completion_tokens ?? this.chunks;
    const span = tFirst === null ? 0 : tLast - tFirst;
    return {
      ttftMs: tFirst === null ? null : Math.round(tFirst - this.t0), tokens: earlierTokens + tokens,
      finish: this.finish, promptTokens: usage?.prompt_tokens ?? null,
      rate: span >= MIN_RATE_SPAN_MS && tokens > 1 ? (tokens - 1) / (span / 1000) : null,
    };
  }
}

// A chat's title written by the model: after the first answer, a short request (not streamed) asks for a few
// words that name the conversation. The chat keeps its first words as title until (and unless) that arrives;
// nothing waits for it, and a failure is silent. Settable off (the checkbox under the chat list).
import { pathOf, titleFrom } from "./conversation.js";

const KEY = "localchat.auto-title";
const TIMEOUT_MS = 30_000;
const PROMPT = "Write a title of at most six words for the conversation below. Reply with the title only: no "
  + "quotes, no punctuation at the end, in the language of the conversation.";

export function autoTitleOn() { return localStorage.getItem(KEY) !== "off"; }

export function initAutoTitleToggle(box) {
  box.checked = autoTitleOn();
  box.addEventListener("change", () => localStorage.setItem(KEY, box.checked ? "on" : "off"));
}

// The title in a model's reply: its first line, without thinking, quotes, markup or a "Title:" label.
export function cleanTitle(text) {
  const line = (text || "").replace(/<think>[\s\S]*?(<\/think>|$)/g, "").trim().split("\n")[0] || "";
  const title = line.replace(/^\s*(title\s*:\s*)/i, "").replace(/^[\s#*"'“”‘’`]+|[\s*"'“”‘’`.。]+$/g, "").trim();
  return title.length > 60 ? `${title.slice(0, 57)}…` : title;
}

// After a chat's first answer: asks for its title and hands it to apply(title, fallback), which names the chat
// unless it is no longer called by its first words (the user renamed it meanwhile).
export async function titleChat(chat, { model, apply }) {
  const path = pathOf(chat);
  if (!autoTitleOn() || path.length !== 2 || path[1].role !== "assistant") return;
  const fallback = titleFrom(path[0].text);
  if (chat.title !== fallback) return;                      // named by the user
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), TIMEOUT_MS);
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, signal: controller.signal,
      body: JSON.stringify({
        ...(model ? { model } : {}), stream: false, max_tokens: 24, temperature: 0.3,
        chat_template_kwargs: { enable_thinking: false },     // a hybrid thinking model answers at once
        messages: [{ role: "system", content: PROMPT },
                   { role: "user", content: `Question: ${path[0].text.slice(0, 2000)}\n\nAnswer: ${path[1].text.slice(0, 2000)}` }],
      }),
    });
    if (!resp.ok) return;
    const title = cleanTitle((await resp.json())?.choices?.[0]?.message?.content);
    if (title) apply(title, fallback);
  } catch {
    // The first words stay the title.
  } finally {
    clearTimeout(timer);
  }
}

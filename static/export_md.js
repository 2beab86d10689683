// A chat as a Markdown document: its title, when it was written, and the conversation on screen (the selected
// versions), each message under a heading with its time. Images, videos and files are named, not embedded.
import { pathOf } from "./conversation.js";
import { fullTime } from "./dates.js";

export function chatMarkdown(chat) {
  const out = [`# ${chat.title || "Untitled chat"}`, "", `_${fullTime(chat.created || chat.updated)}_`, ""];
  for (const node of pathOf(chat)) {
    const who = node.role === "user" ? "You" : "Assistant";
    out.push(`## ${who}${node.time ? ` · ${fullTime(node.time)}` : ""}`, "");
    for (const image of node.images || []) out.push(`*[image: ${image.name || "untitled"}]*`, "");
    for (const video of node.videos || []) out.push(`*[video: ${video.name || "untitled"}]*`, "");
    for (const file of node.files || []) out.push(`*[file: ${file.name}]*`, "");
    if (node.text) out.push(node.text.trim(), "");
    if (node.role === "assistant" && node.status === "stopped") out.push("*(stopped)*", "");
  }
  return `${out.join("\n").trim()}\n`;
}

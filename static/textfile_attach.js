// Text files attached to a message (code, Markdown, CSV, JSON, logs…): read as UTF-8 and sent inline, each as a
// fenced block headed by its name (conversation.js fileBlock), so the model reads them with the question.
import { el, removeButton } from "./dom.js";
import { fileBlock } from "./conversation.js";

export const MAX_TEXT_FILE_BYTES = 512 * 1024;   // about 130,000 tokens: more than a local context holds anyway

const TEXT_EXTENSIONS = new Set(`txt text md markdown rst org tex csv tsv json jsonl ndjson yaml yml toml ini cfg conf
  env properties xml html htm css scss less svg js mjs cjs ts tsx jsx vue svelte py pyi ipynb rb go rs java kt kts scala
  c h cc cpp cxx hpp hh cs swift m mm php pl pm lua r jl dart hs ml ex exs erl clj sh bash zsh fish ps1 bat sql graphql
  proto gradle cmake mk makefile dockerfile gitignore log diff patch srt vtt`.split(/\s+/));
const TEXT_TYPES = /^(text\/|application\/(json|x-ndjson|xml|x-yaml|yaml|toml|javascript|x-sh|sql|x-python|x-tex)\b)/;

export function isTextFile(file) {
  const name = (file.name || "").toLowerCase();
  const ext = name.includes(".") ? name.split(".").pop() : name;
  return TEXT_TYPES.test(file.type || "") || TEXT_EXTENSIONS.has(ext);
}

// About 4 characters a token, of the file as sent (its name and fence too): the meter's estimate before the
// engine counts the real prompt.
export function fileTokens(file) { return Math.ceil(fileBlock(file).length / 4); }

function sizeText(bytes) {
  return bytes < 1024 ? `${bytes} B` : bytes < 1 << 20 ? `${(bytes / 1024).toFixed(1)} KB` : `${(bytes / (1 << 20)).toFixed(1)} MB`;
}

// {name, text, bytes}; throws with a message that says what to do when the file is too large or not text.
export async function readTextFile(file) {
  const name = file.name || "pasted text";
  if (file.size > MAX_TEXT_FILE_BYTES) {
    throw new Error(`“${name}” is ${sizeText(file.size)}; text files up to ${sizeText(MAX_TEXT_FILE_BYTES)} can be `
      + "attached (paste the part that matters, or split the file).");
  }
  const bytes = new Uint8Array(await file.arrayBuffer());
  if (bytes.subarray(0, 8192).includes(0)) throw new Error(`“${name}” is not a text file (it holds binary data).`);
  return { name, text: new TextDecoder("utf-8").decode(bytes), bytes: bytes.length };
}

// A small badge with the file's extension, where a file icon would be.
function badge(name) {
  const ext = /\.(\w+)$/.exec(name)?.[1] || "txt";
  return el("span", "file-icon", ext.slice(0, 4).toUpperCase());
}

function lineCount(text) { return text ? text.split("\n").length - (text.endsWith("\n") ? 1 : 0) : 0; }

export function fileSummary(file) {
  const lines = lineCount(file.text);
  return `${lines} line${lines === 1 ? "" : "s"} · ${sizeText(file.bytes ?? file.text.length)} · ≈ ${fileTokens(file).toLocaleString("en-US")} tokens`;
}

// The composer's chip for an attached file.
export function fileChip(file, onRemove) {
  const box = el("figure", "file-chip");
  box.dataset.testid = "file-chip";
  const name = el("span", "file-name", file.name);
  name.title = file.name;
  const remove = removeButton(file.name, onRemove);
  box.append(badge(file.name), name, el("figcaption", null, fileSummary(file)), remove);
  return box;
}

// A sent message's file: its name and size, its text shown when opened.
export function fileElement(file) {
  const box = el("details", "msg-file");
  const summary = el("summary");
  summary.append(badge(file.name), ` ${file.name}`, el("span", "file-meta", ` · ${fileSummary(file)}`));
  box.append(summary, el("pre", null, file.text));
  return box;
}

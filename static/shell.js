// The page around the conversation: the side panels (chats, KV cache), light/dark theme, drag and drop of
// images, and keyboard shortcuts with their help popover.

const $ = (id) => document.getElementById(id);
const THEMES = ["system", "light", "dark"];

export const SHORTCUTS = [
  ["Enter", "send the message"],
  ["Shift+Enter", "new line in the message"],
  ["Esc", "stop the answer / close this help"],
  ["Ctrl+Shift+O", "new chat"],
  ["Ctrl+Shift+S", "show or hide the chat list"],
  ["Ctrl+Shift+K", "show or hide the KV cache panel"],
  ["Ctrl+Shift+L", "switch theme (system, light, dark)"],
  ["/", "focus the message box"],
  ["Ctrl+/", "this help, from anywhere (the message box too)"],
  ["?", "this help (outside the message box)"],
];

function applyTheme(theme) {
  const resolved = theme === "system" ? (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light") : theme;
  document.documentElement.dataset.theme = resolved;
  document.documentElement.dataset.themeChoice = theme;
  const button = $("theme");
  button.textContent = { system: "◐", light: "☀", dark: "☾" }[theme];
  button.title = `Theme: ${theme} (click to switch)`;
  button.setAttribute("aria-label", button.title);
  // highlight.js ships one stylesheet per theme: only the matching one applies.
  for (const link of document.querySelectorAll("link[data-theme]")) link.media = link.dataset.theme === resolved ? "all" : "not all";
  document.dispatchEvent(new CustomEvent("themechange", { detail: resolved }));   // canvases redraw in its colours
}

function cycleTheme() {
  const now = localStorage.getItem("localchat.theme") || "system";
  const next = THEMES[(THEMES.indexOf(now) + 1) % THEMES.length];
  localStorage.setItem("localchat.theme", next);
  applyTheme(next);
}

function togglePanel(cls, button, open) {
  const show = open ?? !document.body.classList.contains(cls);
  document.body.classList.toggle(cls, show);
  button?.setAttribute("aria-expanded", String(show));
}

function showKV(open) {
  document.body.classList.toggle("kv-hidden", !open);
  $("toggle-kv").setAttribute("aria-expanded", String(open));
}

function renderHelp() {
  const list = $("shortcut-list");
  list.replaceChildren(...SHORTCUTS.flatMap(([keys, what]) => {
    const dt = document.createElement("dt");
    for (const [i, key] of keys.split("+").entries()) {
      if (i) dt.append("+");
      const kbd = document.createElement("kbd");
      kbd.textContent = key;
      dt.append(kbd);
    }
    const dd = document.createElement("dd");
    dd.textContent = what;
    return [dt, dd];
  }));
}

function toggleHelp(open) {
  const help = $("shortcuts");
  help.hidden = !(open ?? help.hidden);
  $("help").setAttribute("aria-expanded", String(!help.hidden));
  if (!help.hidden) help.querySelector("button").focus();
}

export function initShell({ stop, newChat, isBusy, attachments }) {
  applyTheme(localStorage.getItem("localchat.theme") || "system");
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => applyTheme(localStorage.getItem("localchat.theme") || "system"));
  $("theme").addEventListener("click", cycleTheme);

  $("toggle-kv").addEventListener("click", () => showKV(document.body.classList.contains("kv-hidden")));
  $("toggle-sidebar").addEventListener("click", () => togglePanel("sidebar-open", $("toggle-sidebar")));
  // On a phone the conversation needs the room: both panels start folded away there.
  if (matchMedia("(max-width: 900px)").matches) showKV(false);
  else document.body.classList.add("sidebar-open");

  renderHelp();
  $("help").addEventListener("click", () => toggleHelp());
  $("shortcuts").querySelector("button").addEventListener("click", () => toggleHelp(false));

  document.addEventListener("keydown", (e) => {
    const typing = e.target.closest?.("input, textarea, select, [contenteditable]");
    const ctrl = (e.ctrlKey || e.metaKey) && e.shiftKey;
    const key = e.key.toLowerCase();
    if (e.key === "Escape") {
      if (!$("shortcuts").hidden) toggleHelp(false);
      else if (isBusy()) stop();
    } else if (ctrl && key === "o") { e.preventDefault(); newChat(); }
    else if (ctrl && key === "s") { e.preventDefault(); togglePanel("sidebar-open", $("toggle-sidebar")); }
    else if (ctrl && key === "k") { e.preventDefault(); showKV(document.body.classList.contains("kv-hidden")); }
    else if (ctrl && key === "l") { e.preventDefault(); cycleTheme(); }
    // Typing "?" in the message box is text; Ctrl+/ opens the help wherever the focus is.
    else if ((e.ctrlKey || e.metaKey) && !e.shiftKey && e.key === "/") { e.preventDefault(); toggleHelp(); }
    else if (!typing && e.key === "/") { e.preventDefault(); $("prompt").focus(); }
    else if (!typing && e.key === "?") { e.preventDefault(); toggleHelp(); }
  });

  // Drag and drop anywhere on the page; the overlay shows only while files are dragged over.
  const overlay = $("drop-overlay");
  let dragDepth = 0;
  const hasFiles = (e) => [...(e.dataTransfer?.types || [])].includes("Files");
  window.addEventListener("dragenter", (e) => { if (hasFiles(e)) { dragDepth += 1; overlay.hidden = false; } });
  window.addEventListener("dragleave", (e) => { if (hasFiles(e) && --dragDepth <= 0) { dragDepth = 0; overlay.hidden = true; } });
  window.addEventListener("dragover", (e) => { if (hasFiles(e)) e.preventDefault(); });
  window.addEventListener("drop", (e) => {
    if (!hasFiles(e)) return;
    e.preventDefault();
    dragDepth = 0;
    overlay.hidden = true;
    attachments.addFiles([...e.dataTransfer.files]);
  });
}

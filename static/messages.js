// Message elements: the content (user text as typed, answers rendered block by block), the speed line, and
// the actions under each message: its time, copy, regenerate (answers, with ‹ 2/3 › between versions), edit
// (questions: resent as a new branch; answers: saved as a new version), continue (an answer cut off by the
// max-tokens limit or Stop), delete, retry after an error. The actions call back into chat.js by name.
import { StreamRenderer } from "./render.js";
import { showReasoning } from "./reasoning.js";
import { siblingInfo } from "./conversation.js";
import { timeElement } from "./dates.js";
import { el } from "./dom.js";
import { groundingElement } from "./grounding.js";
import { videoElement } from "./video_attach.js";
import { fileElement } from "./textfile_attach.js";

function button(action, label, text, title) {
  const b = el("button", `act act-${action}`, text);
  b.type = "button";
  b.dataset.action = action;
  b.setAttribute("aria-label", label);
  b.title = title || label;
  return b;
}

export function speedText(m) {
  const parts = [];
  if (Number.isFinite(m.ttftMs)) parts.push(`${(m.ttftMs / 1000).toFixed(2)} s to first token`);
  if (Number.isFinite(m.rate)) parts.push(`${m.rate.toFixed(1)} tok/s`);
  if (Number.isFinite(m.tokens)) parts.push(`${m.tokens} token${m.tokens === 1 ? "" : "s"}`);
  return parts.join(" · ");
}

function metaText(node) {
  const m = node.meta || {};
  let text = speedText(m);
  if (node.status === "stopped") text += " · stopped";
  else if (node.status === "error") text += " · incomplete";
  else if (m.finish === "length") text += " · hit the max-tokens limit";
  if (m.edited) text += " · edited";
  if (m.note) text += ` · ${m.note}`;
  return text.replace(/^ · /, "");
}

// A question: its images (each with "Find…", which asks the model to locate things in it), videos, text
// files, and the user's own words, shown exactly as typed.
export function userContent(content, node) {
  content.replaceChildren();
  if (node.images?.length) {
    const row = el("div", "msg-images");
    node.images.forEach((image, index) => {
      const wrap = el("span", "msg-image");
      const img = el("img");
      img.src = image.url;
      img.alt = image.name || "image";
      const find = el("button", "find", "Find…");
      find.type = "button";
      Object.assign(find.dataset, { node: node.id, index: String(index) });
      find.title = "Ask the model where things are in this image (it answers with boxes drawn here)";
      find.setAttribute("aria-label", `Find things in ${img.alt}`);
      wrap.append(img, find);
      row.append(wrap);
    });
    content.append(row);
  }
  for (const video of node.videos || []) content.append(videoElement(video));
  for (const file of node.files || []) content.append(fileElement(file));
  if (node.text) content.append(el("p", null, node.text));
}

// One message; `streaming` answers get their renderer kept on the element (box.renderer).
export function messageElement(chat, node, { streaming = false } = {}) {
  const box = el("article", `msg ${node.role}`);
  box.dataset.id = node.id;
  box.setAttribute("aria-label", node.role === "user" ? "You" : "Assistant");
  const content = el("div", "content");
  box.append(content);
  if (node.role === "user") {
    userContent(content, node);
  } else {
    box.renderer = new StreamRenderer(content);
    box.renderer.update(node.text);
    showReasoning(box, node, streaming);
    box.dataset.status = streaming ? "streaming" : node.status;
    if (streaming) box.classList.add("streaming");
  }
  box.append(actionsElement(chat, node));
  if (streaming) box.querySelector(".actions").hidden = true;
  else if (node.role === "assistant") finishElement(chat, box, node);
  return box;
}

// After an answer ends: its speed line, its status, its actions (retry after an error).
export function finishElement(chat, box, node) {
  box.classList.remove("streaming");
  showReasoning(box, node);
  box.dataset.status = node.status;
  box.dataset.tokens = String(node.meta?.tokens ?? "");
  box.dataset.ttftMs = String(node.meta?.ttftMs ?? "");
  box.querySelector(".meta")?.remove();
  const text = metaText(node);
  if (text) {
    const meta = el("div", "meta", text);
    meta.dataset.testid = "speed";
    box.querySelector(".content").after(meta);
  }
  box.querySelector(".grounding")?.remove();
  const marks = groundingElement(chat, node);     // boxes and points in the answer, drawn on the image
  if (marks) box.querySelector(".content").after(marks);
  box.querySelector(".actions").replaceWith(actionsElement(chat, node));
}

function actionsElement(chat, node) {
  const bar = el("div", "actions");
  if (node.time) bar.append(timeElement(node.time, "msg-time"));
  const { index, count } = siblingInfo(chat, node.id);
  if (count > 1) {
    const nav = el("span", "versions");
    nav.append(button("prev", "Previous version", "‹"),
               el("span", "version-count", `${index + 1}/${count}`),
               button("next", "Next version", "›"));
    nav.querySelector(".act-prev").disabled = index === 0;
    nav.querySelector(".act-next").disabled = index === count - 1;
    bar.append(nav);
  }
  bar.append(button("copy", "Copy message", "Copy"));
  if (node.role === "user") bar.append(button("edit", "Edit and resend", "Edit"));
  // A question left without an answer (the page was closed while it streamed): ask for one.
  if (node.role === "user" && !node.children.length) bar.append(button("answer", "Answer this message", "Answer"));
  if (node.role === "assistant") {
    if (node.status === "stopped" || node.meta?.finish === "length") {
      bar.append(button("continue", "Continue this answer from where it stopped", "Continue"));
    }
    bar.append(button("edit", "Edit this answer (kept as a new version)", "Edit"));
    bar.append(node.status === "error" ? button("retry", "Retry this answer", "Retry")
                                       : button("regenerate", "Regenerate this answer", "Regenerate"));
  }
  bar.append(button("delete", "Delete message (and what follows it)", "Delete"));
  return bar;
}

// The editor that replaces a message's content while it is edited; resolves with the new text or null.
export function editInPlace(box, node, { submit = "Send" } = {}) {
  return new Promise((resolve) => {
    const content = box.querySelector(".content");
    const actions = box.querySelector(".actions");
    const form = el("form", "edit-form");
    const area = el("textarea", "edit-text");
    area.value = node.text;
    area.rows = Math.min(node.role === "assistant" ? 20 : 10, Math.max(2, node.text.split("\n").length));
    area.setAttribute("aria-label", "Edit message");
    const save = el("button", "primary", submit);
    save.type = "submit";
    const cancel = el("button", "ghost", "Cancel");
    cancel.type = "button";
    const bar = el("div", "edit-bar");
    bar.append(cancel, save);
    form.append(area, bar);
    content.hidden = true;
    actions.hidden = true;
    content.after(form);
    const done = (value) => { form.remove(); content.hidden = false; actions.hidden = false; resolve(value); };
    form.addEventListener("submit", (e) => { e.preventDefault(); done(area.value.trim() || null); });
    cancel.addEventListener("click", () => done(null));
    area.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); form.requestSubmit(); }
      if (e.key === "Escape") { e.stopPropagation(); done(null); }
    });
    area.focus();
  });
}

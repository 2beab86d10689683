// The "newest message" button: shown while the conversation is scrolled up from its end (an answer streaming
// below what is read, or an old part of a long chat), it jumps back to the end.

import { el } from "./dom.js";

const NEAR = 120;   // px from the end that still count as "at the end"

export function initScrollButton(messages) {
  const holder = el("div", "scroll-down-holder");
  const button = el("button", "scroll-down", "↓");
  button.type = "button";
  button.id = "scroll-down";
  button.title = "Scroll to the newest message";
  button.setAttribute("aria-label", button.title);
  button.hidden = true;
  holder.append(button);
  messages.after(holder);

  let frame = 0;
  const update = () => {
    frame = 0;
    button.hidden = messages.scrollHeight - messages.scrollTop - messages.clientHeight < NEAR;
  };
  const later = () => { if (!frame) frame = requestAnimationFrame(update); };
  messages.addEventListener("scroll", later, { passive: true });
  new MutationObserver(later).observe(messages, { childList: true, subtree: true, characterData: true });
  new ResizeObserver(later).observe(messages);
  button.addEventListener("click", () => { messages.scrollTop = messages.scrollHeight; });
  return button;
}

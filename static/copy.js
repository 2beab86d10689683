// Copying to the clipboard from a button that says how it went ("Copied", or "Copy failed") for a moment.

export async function copyWithFeedback(button, text) {
  const label = (button.dataset.label ??= button.textContent);
  let ok = true;
  try { await navigator.clipboard.writeText(text); } catch { ok = false; }
  button.textContent = ok ? "Copied" : "Copy failed";
  button.classList.toggle("copied", ok);
  clearTimeout(Number(button.dataset.timer));
  button.dataset.timer = String(setTimeout(() => { button.textContent = label; button.classList.remove("copied"); }, 1500));
  return ok;
}

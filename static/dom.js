// The DOM helpers the page's modules share: an element with its class and text (text only ever as
// textContent, never parsed as HTML), an attachment's remove button, and a file read as a data: URL.

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function removeButton(name, onRemove) {
  const remove = el("button", "remove", "×");
  remove.type = "button";
  remove.setAttribute("aria-label", `Remove ${name}`);
  remove.addEventListener("click", onRemove);
  return remove;
}

export function readAsDataURL(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

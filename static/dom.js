// The one DOM helper the page's modules share: an element with its class and text (text only ever as
// textContent, never parsed as HTML).

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

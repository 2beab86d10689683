// What the buttons under a message do: copy, step through versions, delete, answer, regenerate or retry,
// continue a cut-off answer, edit a question (a new version, answered again) or an answer (a new version).
import { addChild, pathOf, selectSibling } from "./conversation.js";
import { copyWithFeedback } from "./copy.js";
import { editInPlace, messageElement } from "./messages.js";

// The page's state and the controller's functions it acts through; returns onAction(action, id, button).
export function messageActions({ app, ui, save, generate, renderConversation, removeMessage, hideError, showError }) {
  // Before a regenerate: the conversation up to the question, with the new answer streaming below it.
  function renderConversationUpTo(user) {
    const path = pathOf(app.chat);
    const keep = path.slice(0, path.indexOf(user) + 1);
    ui.messages.replaceChildren(...keep.map((n) => messageElement(app.chat, n)));
  }

  return async function onAction(action, id, button) {
    const chat = app.chat;
    const node = chat.nodes[id];
    if (!node) return;
    if (action === "copy") {
      if (!(await copyWithFeedback(button, node.text))) showError("Copying needs clipboard access.");
      return;
    }
    if (action === "prev" || action === "next") {
      selectSibling(chat, id, action === "prev" ? -1 : 1);
      renderConversation();
      await save(chat);
      return;
    }
    if (app.controller) return;   // nothing else while an answer streams
    if (action === "delete") {
      removeMessage(chat, id);
      renderConversation();
      await save(chat);
    } else if (action === "answer") {
      hideError();
      await generate(chat, node);
      await save(chat);
    } else if (action === "regenerate" || action === "retry") {
      hideError();
      renderConversationUpTo(chat.nodes[node.parent]);
      await generate(chat, chat.nodes[node.parent]);   // the answer's element is finished in place (a selection stays)
      await save(chat);
    } else if (action === "continue") {
      hideError();
      await generate(chat, chat.nodes[node.parent], node);
      await save(chat);
    } else if (action === "edit" && node.role === "assistant") {
      // An edited answer is a new version of it (the model's own stays one click away).
      const text = await editInPlace(ui.messages.querySelector(`[data-id="${id}"]`), node, { submit: "Save" });
      if (text === null || text === node.text) return;
      addChild(chat, node.parent, { role: "assistant", text, meta: { edited: true } });
      renderConversation();
      await save(chat);
    } else if (action === "edit") {
      const box = ui.messages.querySelector(`[data-id="${id}"]`);
      const text = await editInPlace(box, node);
      if (text === null || (text === node.text)) return;
      const { images, videos, files } = node;     // the edited question keeps what was attached to it
      const edited = addChild(chat, node.parent, { role: "user", text, images, videos, files });
      renderConversation();
      save(chat);
      await generate(chat, edited);
      await save(chat);
    }
  };
}

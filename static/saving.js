// The page's chats in the browser: each save (store.js merges it with the stored copy, so no turn another tab
// added is lost), what other tabs saved or deleted (tabsync.js), and a model-written title.

import { pathOf, titleFrom } from "./conversation.js";
import { TabSync } from "./tabsync.js";

export class ChatSaving {
  // app: the page's state ({store, chats, chat, controller, sidebar, refreshing}); render(): draw app.chat again;
  // show(chat): its settings on screen; open(id): open a chat (null: a new one); showError(message).
  constructor({ app, render, show, open, showError }) {
    Object.assign(this, { app, render, show, open, showError });
    this.underWay = 0;
    this.tabs = new TabSync({ store: app.store, saved: (c) => this.savedElsewhere(c), deleted: (id) => this.deletedElsewhere(id) });
  }

  // body[data-saving] counts the saves under way: a reload (or a test) knows when every change is stored.
  async save(chat = this.app.chat) {
    document.body.dataset.saving = String(++this.underWay);
    try {
      await this.store(chat);
    } finally {
      document.body.dataset.saving = String(--this.underWay);
    }
  }

  // A chat left without messages (its only question failed and was taken back) is not kept: no ghost chats.
  async store(chat) {
    const app = this.app;
    try {
      if (!Object.keys(chat.nodes).some((k) => k !== "root")) {
        if (app.chats.includes(chat)) { app.chats = app.chats.filter((c) => c !== chat); app.sidebar.render(); }
        await app.store.delete(chat.id);
        return;
      }
      if (!chat.title) chat.title = titleFrom(pathOf(chat).find((n) => n.role === "user")?.text);
      if (!app.chats.includes(chat)) app.chats.unshift(chat);
      app.chats.sort((a, b) => b.updated - a.updated);
      app.sidebar.render();
      const merged = await app.store.put(chat);       // another tab's turns in this chat come in, none is lost
      if (merged && chat === app.chat && !app.controller) this.render();
    } catch (err) { this.showError(`This chat could not be saved in the browser: ${err.message}`); return; }
    this.tabs.saved(chat);
  }

  // Another tab saved this chat: its stored copy replaces ours, unless an answer is streaming into ours here.
  savedElsewhere(stored) {
    const app = this.app;
    if (app.controller && app.chat.id === stored.id) return;
    const i = app.chats.findIndex((c) => c.id === stored.id);
    if (i >= 0) app.chats[i] = stored; else app.chats.push(stored);
    app.chats.sort((a, b) => b.updated - a.updated);
    if (app.chat.id !== stored.id) { app.sidebar?.render(); return; }
    app.chat = stored;
    this.show(stored);
    this.render();
  }

  deletedElsewhere(id) {
    const app = this.app;
    app.chats = app.chats.filter((c) => c.id !== id);
    if (app.chat.id === id && !app.controller) this.open(null); else app.sidebar?.render();
  }

  // A title the model wrote, for the chat as it is now (another tab may have replaced our copy meanwhile).
  retitle(id, title, fallback) {
    const chat = this.app.chats.find((c) => c.id === id);
    if (chat?.title !== fallback) return;
    chat.title = title;
    this.save(chat);
  }

  // Another tab may have added turns to this chat: they are merged in when this tab is looked at again and when
  // the user types (at most one read in flight), so that a message sent here follows them.
  refresh() {
    const app = this.app;
    const chat = app.chat;
    app.refreshing ??= app.store.refresh(chat)
      .then((changed) => { if (changed && chat === app.chat && !app.controller) this.render(); })
      .catch(() => {})
      .finally(() => { app.refreshing = null; });
    return app.refreshing;
  }
}

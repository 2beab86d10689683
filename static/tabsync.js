// Tabs of the page stay in step: a tab that saves or deletes a chat says so on a BroadcastChannel, and the
// other tabs read that chat back from IndexedDB, the one copy they all share.

export class TabSync {
  // app: {store, saved(chat) (another tab saved it: here is the stored copy), deleted(id)}
  constructor({ store, saved, deleted }) {
    this.channel = "BroadcastChannel" in window ? new BroadcastChannel("localchat-chats") : null;
    this.channel?.addEventListener("message", async ({ data }) => {
      if (data?.type === "deleted") { deleted(data.id); return; }
      if (data?.type !== "saved") return;
      const chat = (await store.all()).find((c) => c.id === data.id);
      if (chat) saved(chat);
    });
  }

  saved(chat) { this.channel?.postMessage({ type: "saved", id: chat.id }); }

  deleted(id) { this.channel?.postMessage({ type: "deleted", id }); }
}

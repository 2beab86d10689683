// The chat request for a conversation path: its messages (the media that fit the server's limits), the chat's
// sampling settings, the frames to sample from its newest video, and a note on earlier media not sent again.
import { buildMessages } from "./conversation.js";
import { videoKwargs } from "./video_attach.js";

const MB = 1 << 20;

// {body, note}; throws when the last message's own media do not fit one request.
export function chatRequest(path, { settings, limits, model }) {
  const { messages, dropped, droppedVideos, droppedLast } = buildMessages(path, {
    system: settings.system, maxImages: limits.maxImages, maxVideos: limits.video.maxVideos,
    maxBytes: limits.maxBytes, keepEarlier: settings.keepEarlierImages });
  if (droppedLast) {
    throw new Error(`The attachments of this message are too large together for the server's limit of `
      + `${(limits.maxBytes / MB).toFixed(1)} MB per request (or more than it takes in one prompt): remove `
      + `${droppedLast === 1 ? "one" : droppedLast} of them.`);
  }
  const body = { messages, stream: true, stream_options: { include_usage: true, continuous_usage_stats: true },
                 ...settings.requestFields() };
  const sent = new Set(messages.flatMap((m) => (Array.isArray(m.content) ? m.content : []))
    .filter((p) => p.type === "video_url").map((p) => p.video_url.url));
  const kwargs = videoKwargs(path.flatMap((n) => n.videos || []).filter((v) => sent.has(v.url)), limits.video);
  if (kwargs) body.mm_processor_kwargs = kwargs;
  if (model) body.model = model;
  return { body, note: droppedNote(dropped, droppedVideos, limits) };
}

function droppedNote(images, videos, limits) {
  const notes = [];
  if (images) {
    notes.push(`${images} earlier image${images === 1 ? " is" : "s are"} not sent again: the model takes at most `
      + `${limits.maxImages} images per prompt and requests at most ${Math.round(limits.maxBytes / MB)} MB (Settings → Earlier images).`);
  }
  if (videos) {
    notes.push(`${videos} earlier video${videos === 1 ? " is" : "s are"} not sent again: the model takes at most `
      + `${limits.video.maxVideos} video${limits.video.maxVideos === 1 ? "" : "s"} per prompt.`);
  }
  return notes.join(" ");
}

// Videos attached to a message: sent whole as a data: URL in a video_url content part; the engine decodes the
// clip and samples its frames. The composer's card shows a poster frame, the duration, how many frames will be
// sent and what they cost in vision tokens, with a slider to send fewer (mm_processor_kwargs.num_frames).
import { el, readAsDataURL, removeButton } from "./dom.js";

// Qwen3-VL's video processor (its video_preprocessor_config.json: fps 2, at least 4 frames, at most 25,165,824
// pixels over all frames, at least 4,096) and the engine's frame and video limits. GET /v1/models may say
// otherwise (card.video: fps, min_frames, max_frames, min_pixels, max_pixels; card.max_videos_per_prompt).
export const VIDEO_DEFAULTS = { fps: 2, minFrames: 4, maxFrames: 64, minPixels: 4096, maxPixels: 25165824, maxVideos: 1 };
const FACTOR = 32;           // patch 16 × spatial merge 2: one vision token per 32×32 pixels of a frame
const TEMPORAL_PATCH = 2;    // two frames make one temporal patch
const POSTER_SIDE = 320;

export function videoLimits(card) {
  const v = card?.video || {};
  const num = (x, d) => (Number.isFinite(x) && x > 0 ? x : d);
  return { fps: num(v.fps, VIDEO_DEFAULTS.fps), minFrames: num(v.min_frames, VIDEO_DEFAULTS.minFrames),
           maxFrames: num(v.max_frames, VIDEO_DEFAULTS.maxFrames), minPixels: num(v.min_pixels, VIDEO_DEFAULTS.minPixels),
           maxPixels: num(v.max_pixels, VIDEO_DEFAULTS.maxPixels),
           maxVideos: Number.isInteger(card?.max_videos_per_prompt) ? card.max_videos_per_prompt : VIDEO_DEFAULTS.maxVideos };
}

// Python's round (half to even), as the processor rounds.
function roundEven(x) {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 && r % 2 ? r - 1 : r;
}

// The frame size the processor resizes to (transformers' Qwen3-VL video smart_resize), as [height, width].
export function frameSize(frames, height, width, lim = VIDEO_DEFAULTS) {
  if (height < FACTOR || width < FACTOR) {
    const scale = Math.max(FACTOR / height, FACTOR / width);
    height = Math.trunc(height * scale);
    width = Math.trunc(width * scale);
  }
  let h = roundEven(height / FACTOR) * FACTOR;
  let w = roundEven(width / FACTOR) * FACTOR;
  const t = roundEven(frames / TEMPORAL_PATCH) * TEMPORAL_PATCH;
  if (t * h * w > lim.maxPixels) {
    const beta = Math.sqrt((frames * height * width) / lim.maxPixels);
    h = Math.max(FACTOR, Math.floor(height / beta / FACTOR) * FACTOR);
    w = Math.max(FACTOR, Math.floor(width / beta / FACTOR) * FACTOR);
  } else if (t * h * w < lim.minPixels) {
    const beta = Math.sqrt(lim.minPixels / (frames * height * width));
    h = Math.ceil((height * beta) / FACTOR) * FACTOR;
    w = Math.ceil((width * beta) / FACTOR) * FACTOR;
  }
  return [h, w];
}

// Frames sampled at the processor's rate (at least minFrames), and the most the engine takes.
function naturalFrames(duration, lim) { return Math.max(lim.minFrames, Math.floor(duration * lim.fps)); }
export function defaultFrames(duration, lim = VIDEO_DEFAULTS) { return Math.min(naturalFrames(duration, lim), lim.maxFrames); }

// Vision tokens of the video as sent: one per 32×32 pixels of each resized frame, per temporal patch of 2 frames.
export function videoTokens(video, lim = VIDEO_DEFAULTS) {
  const [h, w] = frameSize(video.frames, video.height, video.width, lim);
  return Math.ceil(video.frames / TEMPORAL_PATCH) * (h / FACTOR) * (w / FACTOR);
}

// The request's mm_processor_kwargs for the newest video sent: its frame count where that is not what the
// processor's rate gives (the user lowered it, or the engine's limit caps it); none where it is.
export function videoKwargs(videos, lim = VIDEO_DEFAULTS) {
  const v = videos[videos.length - 1];
  return v && v.frames < naturalFrames(v.duration, lim) ? { num_frames: v.frames } : null;
}

function once(target, event, ms, what) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`timed out ${what}`)), ms);
    target.addEventListener(event, () => { clearTimeout(timer); resolve(); }, { once: true });
    target.addEventListener("error", () => { clearTimeout(timer); reject(new Error("the browser cannot decode it")); }, { once: true });
  });
}

// Recorded WebM (and some MP4) files leave the duration out of their header: the browser finds it once asked
// to seek past the end.
async function knownDuration(video) {
  if (Number.isFinite(video.duration)) return video.duration;
  const found = once(video, "durationchange", 5000, "reading the duration");
  video.currentTime = 1e9;
  await found;
  return video.duration;
}

// {url, name, bytes, duration, width, height, poster, frames}; throws with a message that says what to do.
export async function readVideo(file, { maxBytes, limits = VIDEO_DEFAULTS }) {
  const name = file.name || "video";
  const sent = Math.ceil(file.size / 3) * 4;   // as base64
  if (sent + 8192 > maxBytes) {
    throw new Error(`“${name}” is ${(file.size / (1 << 20)).toFixed(1)} MB; the server takes requests up to `
      + `${(maxBytes / (1 << 20)).toFixed(1)} MB and a video grows by a third as base64: trim or compress it.`);
  }
  const src = URL.createObjectURL(file);
  const video = document.createElement("video");
  video.muted = true;
  video.preload = "auto";
  video.src = src;
  try {
    await once(video, "loadedmetadata", 10000, "reading the video");
    const duration = await knownDuration(video);
    const { videoWidth: width, videoHeight: height } = video;
    if (!width || !height || !(duration > 0)) throw new Error("it has no video picture");
    const seeked = once(video, "seeked", 5000, "reading a frame");
    video.currentTime = Math.min(1, duration / 4);   // past a fade-in, early enough to say what the clip is
    await seeked;
    const scale = Math.min(1, POSTER_SIDE / Math.max(width, height));
    const canvas = document.createElement("canvas");
    canvas.width = Math.max(1, Math.round(width * scale));
    canvas.height = Math.max(1, Math.round(height * scale));
    canvas.getContext("2d").drawImage(video, 0, 0, canvas.width, canvas.height);
    return { url: await readAsDataURL(file), name, bytes: file.size, duration, width, height,
             poster: canvas.toDataURL("image/jpeg", 0.8), frames: defaultFrames(duration, limits) };
  } catch (err) {
    throw new Error(`“${name}” could not be read as a video (${err.message}); this browser plays MP4 (H.264) and WebM.`);
  } finally {
    video.removeAttribute("src");
    video.load();
    URL.revokeObjectURL(src);
  }
}

export function durationText(seconds) {
  const s = Math.round(seconds);
  return s < 60 ? `0:${String(s).padStart(2, "0")}` : `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

function costText(video, lim) {
  return `${video.frames} frames · ≈ ${videoTokens(video, lim).toLocaleString("en-US")} tokens`;
}

// The composer's card for an attached video: poster, duration, size, frames and tokens, and the frames slider.
export function videoCard(video, lim, { onRemove, onChange }) {
  const box = el("figure", "video-card");
  box.dataset.testid = "video-card";
  const poster = el("div", "video-poster");
  const img = el("img");
  img.src = video.poster;
  img.alt = video.name;
  poster.append(img, el("span", "video-duration", durationText(video.duration)));
  const cost = el("span", "video-cost", costText(video, lim));
  const most = defaultFrames(video.duration, lim);
  const slider = el("input", "video-frames");
  Object.assign(slider, { type: "range", min: String(Math.min(TEMPORAL_PATCH, most)), max: String(most), step: "1",
                          value: String(video.frames) });
  slider.disabled = most <= TEMPORAL_PATCH;
  slider.setAttribute("aria-label", `Frames of ${video.name} to send`);
  slider.title = "Fewer frames: fewer tokens and a faster answer, less of the motion seen";
  slider.addEventListener("input", () => {
    video.frames = Number(slider.value);
    cost.textContent = costText(video, lim);
    onChange();
  });
  const cap = el("figcaption");
  cap.append(el("span", "video-name", video.name), el("span", "video-size", `${video.width}×${video.height}`), cost, slider);
  const remove = removeButton(video.name, onRemove);
  box.append(poster, cap, remove);
  return box;
}

// A sent message's video: playable, with the frames it was sent with.
export function videoElement(video) {
  const box = el("figure", "msg-video");
  const player = el("video");
  Object.assign(player, { controls: true, preload: "metadata", poster: video.poster || "", src: video.url });
  player.setAttribute("aria-label", video.name);
  box.append(player, el("figcaption", null, `${video.name} · ${durationText(video.duration)} · ${video.frames} frames sent`));
  return box;
}

// Dates as the page shows them, in the browser's language: a short form next to a message or under a group of
// chats, and the full date and time for a tooltip.

import { el } from "./dom.js";

const DAY = 86_400_000;

function startOfDay(ms) {
  const d = new Date(ms);
  d.setHours(0, 0, 0, 0);
  return d.getTime();
}

export function fullTime(ms) {
  return new Date(ms).toLocaleString(undefined, { dateStyle: "full", timeStyle: "short" });
}

// "14:05" today, "Mar 3, 14:05" this year, "Mar 3, 2025" before.
export function shortTime(ms, now = Date.now()) {
  const d = new Date(ms);
  if (startOfDay(ms) === startOfDay(now)) return d.toLocaleTimeString(undefined, { timeStyle: "short" });
  if (d.getFullYear() === new Date(now).getFullYear()) {
    return d.toLocaleString(undefined, { month: "short", day: "numeric", hour: "numeric", minute: "2-digit" });
  }
  return d.toLocaleDateString(undefined, { dateStyle: "medium" });
}

// The group a chat last written at `ms` falls in: Today, Yesterday, Previous 7 days, Previous 30 days, then
// month and year.
export function dayGroup(ms, now = Date.now()) {
  const days = Math.round((startOfDay(now) - startOfDay(ms)) / DAY);
  if (days <= 0) return "Today";
  if (days === 1) return "Yesterday";
  if (days <= 7) return "Previous 7 days";
  if (days <= 30) return "Previous 30 days";
  return new Date(ms).toLocaleDateString(undefined, { month: "long", year: "numeric" });
}

export function timeElement(ms, className) {
  const t = el("time", className, shortTime(ms));
  t.dateTime = new Date(ms).toISOString();
  t.title = fullTime(ms);
  return t;
}

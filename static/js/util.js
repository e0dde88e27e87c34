// Small helpers every module may use: browser storage, ids, announcements, lengths and durations.
import { els } from './dom.js';

/** Web storage as JSON; private mode or a full quota only means nothing is remembered. */
function jsonStorage(area) {
  return {
    get(key, fallback) {
      try {
        const raw = area().getItem(key);
        return raw === null ? fallback : JSON.parse(raw);
      } catch { return fallback; }
    },
    set(key, value) {
      try { area().setItem(key, JSON.stringify(value)); } catch { /* private mode, quota */ }
    },
    remove(key) {
      try { area().removeItem(key); } catch { /* ignore */ }
    },
  };
}

/** What every tab shares (settings, titles). */
export const storage = jsonStorage(() => localStorage);
/** What belongs to this tab alone and survives its reload (the answer it was showing). */
export const tabStorage = jsonStorage(() => sessionStorage);

/** A request id in the protocol's alphabet. */
export function newId() {
  // crypto.randomUUID needs a secure context; getRandomValues works over plain http too.
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return 'c' + Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}

/** Say something to screen readers. */
export function announce(text) {
  els.announcer.textContent = '';
  // A fresh text node after a tick makes screen readers read repeated messages too.
  setTimeout(() => { els.announcer.textContent = text; }, 30);
}

/** Length in code points, as the server counts ``max_content_chars``. */
export function charLength(text) {
  let n = 0;
  for (const _ of text) n += 1;
  return n;
}

export function fmtDuration(ms) {
  if (ms < 1000) return `${Math.round(ms)} ms`;
  return ms < 10000 ? `${(ms / 1000).toFixed(2)} s` : `${(ms / 1000).toFixed(1)} s`;
}

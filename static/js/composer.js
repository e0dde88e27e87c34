// The composer: the message box, Send and Stop, the character count, and the error line above it.
import { els } from './dom.js';
import * as socket from './socket.js';
import { charLength } from './util.js';

let composing = false; // an IME composition is open
let queued = false; // the box's text goes out when the answer being written ends (or the connection is back)
let connectionError = false; // the error line speaks of the connection: the next `ready` clears it

const FRIENDLY = {
  too_large: () => {
    const max = socket.limits().max_content_chars;
    return `That message is too long${max ? ` (the limit is ${max.toLocaleString()} characters)` : ''}.`;
  },
  busy: () => 'An answer is still being written. Wait for it to finish or press Stop.',
  rate_limited: () => 'You are sending messages too quickly. Please wait a moment and try again.',
  overloaded: () => (socket.isRestarting()
    ? 'The server is restarting. Your message is kept and goes out once it is back.'
    : 'The server is at capacity right now. Please try again in a moment.'),
  not_found: () => 'This conversation no longer exists.',
  internal: () => 'The server ran into a problem. Please try again.',
};

/** What to tell a person about an error code (the server's message when there is no better one). */
export function errorText(code, message) {
  const friendly = FRIENDLY[code];
  return friendly ? friendly() : (message || code || 'Something went wrong.');
}

/** Show ``text`` on the error line; ``connection``: it is about the connection, and goes by itself
 * when the connection is back. */
export function showError(text, { connection = false } = {}) {
  els.error.textContent = text;
  els.error.hidden = false;
  connectionError = connection;
}

export function clearError() {
  els.error.hidden = true;
  els.error.textContent = '';
  connectionError = false;
}

/** The connection is back: an error line about it goes. */
export function clearConnectionError() {
  if (connectionError) clearError();
}

/** The message to send: the box's text without leading blank lines or trailing space. */
export const content = () => els.prompt.value.replace(/^\s*\n/, '').trimEnd();

/** True when ``text`` is over the server's ``max_content_chars``. */
export function tooLong(text) {
  const max = socket.limits().max_content_chars;
  return Boolean(max) && charLength(text) > max;
}

export function clear() {
  els.prompt.value = '';
  autosize();
}

/** Give back the text of a refused message, unless something new was typed meanwhile. */
export function restore(text) {
  if (text && !els.prompt.value.trim()) {
    els.prompt.value = text;
    autosize();
  }
}

/** Grow the box with its text where CSS cannot (no field-sizing support). */
export function autosize() {
  if (CSS.supports('field-sizing', 'content')) return;
  els.prompt.style.height = 'auto';
  els.prompt.style.height = `${Math.min(els.prompt.scrollHeight, window.innerHeight * 0.4)}px`;
}

export const setComposing = (value) => { composing = value; };
export const isComposing = () => composing;

/** Enter sends; Shift/Alt+Enter and the Enter that confirms an IME candidate never do. */
export function isSendKey(e) {
  if (e.key !== 'Enter' || e.shiftKey || e.altKey) return false;
  return !(e.isComposing || e.keyCode === 229 || composing);
}

const WAITS_FOR = {
  answer: 'Sends when this answer finishes.',
  connection: 'Sends when the connection is back.',
  restart: 'The server is restarting: this sends once it is back.',
  load: 'Sends once this conversation has loaded.',
};

/** Mark the box's text to be sent when the answer being written ends, the connection is back or
 * the conversation has loaded (``why``: 'answer', 'connection', 'restart', 'load'), or not. */
export function setQueued(value, why = 'answer') {
  queued = value;
  els.queued.hidden = !value;
  els.queued.dataset.why = value ? why : '';
  if (value) els.queuedText.textContent = WAITS_FOR[why] || WAITS_FOR.answer;
  els.prompt.classList.toggle('queued', value);
}

export const isQueued = () => queued;

/** Send or Stop (both while an answer streams and something is typed), whether Send is possible
 * and why not, and the count when a message nears the limit. */
export function update(streaming) {
  const focused = [els.send, els.stop].find((b) => b === document.activeElement);
  const text = els.prompt.value;
  if (queued && !text.trim()) setQueued(false);
  els.send.hidden = streaming && !text.trim();
  els.stop.hidden = !streaming;
  els.send.disabled = !text.trim() || queued;
  els.send.classList.toggle('waiting', streaming);
  let why = 'Send (Enter)';
  if (queued) why = `Queued: ${els.queuedText.textContent}`;
  else if (socket.isRestarting()) why = 'Send when the server is back (Enter)';
  else if (!socket.isReady()) why = 'Send when the connection is back (Enter)';
  else if (streaming) why = 'Send when this answer finishes (Enter)';
  els.send.title = why;
  els.send.setAttribute('aria-label', why);
  if (focused?.hidden) (focused === els.send ? els.stop : els.send).focus();
  const max = socket.limits().max_content_chars;
  const length = max && text.length > max * 0.5 ? charLength(text) : 0;
  if (max && length > max * 0.8) {
    els.charCount.textContent = `${length.toLocaleString()} / ${max.toLocaleString()}`;
    els.charCount.classList.toggle('over', length > max);
  } else {
    els.charCount.textContent = '';
  }
}

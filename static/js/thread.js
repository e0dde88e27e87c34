// The message list: adding and clearing messages, streaming renders batched per frame,
// following the latest line while the reader lets it, and the copy buttons.
import { els } from './dom.js';
import { AssistantMessage, userMessage } from './message.js';
import { codeTextFor } from './markdown.js';
import { ICON_CHECK } from './icons.js';
import { announce } from './util.js';

let follow = true;
let lastScrollTop = 0;
let expectedScrollTop = -1;
const dirty = new Map(); // view -> its newest text, drawn at the next frame
let frameRequested = false;

// ---------------------------------------------------------------- messages

/** Add a node (a message) at the end. */
export function append(node) {
  els.empty.hidden = true;
  els.thread.append(node);
}

/** Add a user message; returns its element. */
export function appendUser(content) {
  const el = userMessage(content);
  append(el);
  return el;
}

/** The last message element, or undefined. */
export const lastMessage = () => [...els.thread.querySelectorAll('.msg')].pop();

/** Empty the thread; the welcome text shows when ``showEmpty``. */
export function reset(showEmpty) {
  for (const node of [...els.thread.children]) if (node !== els.empty) node.remove();
  els.empty.hidden = !showEmpty;
  follow = true;
}

/** Show the welcome text again once the last message is gone. */
export function showEmptyIfNone() {
  if (!els.thread.querySelector('.msg')) els.empty.hidden = false;
}

/** Draw a stored conversation, then the ``live`` requests ({userEl, view}) still streaming into it. */
export function showStored(messages, live) {
  reset(false);
  const shown = messages.filter((m) => m.role === 'user' || m.role === 'assistant');
  // The live answer is drawn from the stream; drop the partial copy the store holds.
  if (live.length) while (shown.length && shown[shown.length - 1].role === 'assistant') shown.pop();
  for (const m of shown) {
    if (m.role === 'user') {
      appendUser(m.content);
    } else {
      const view = new AssistantMessage();
      append(view.el);
      view.setText(m.content, true);
      view.finish(m);
    }
  }
  for (const req of live) {
    if (req.userEl && !shown.length) els.thread.append(req.userEl);
    els.thread.append(req.view.el);
  }
  els.empty.hidden = els.thread.querySelector('.msg') !== null;
  requestAnimationFrame(() => { follow = true; scrollToBottom(); updateJump(); });
}

/** Regenerate shows on the last answer only, and never while ``hidden``. */
export function updateRegenerate(hidden) {
  const last = lastMessage();
  for (const button of els.thread.querySelectorAll('[data-action="regenerate"]')) {
    button.hidden = hidden || button.closest('.msg') !== last;
  }
}

// ---------------------------------------------------------------- streaming, one render per frame

/** Draw ``text`` into ``view`` at the next animation frame. */
export function scheduleRender(view, text) {
  dirty.set(view, text);
  if (!frameRequested) {
    frameRequested = true;
    requestAnimationFrame(renderFrame);
  }
}

/** Drop a pending render (the caller draws the final text itself). */
export function cancelRender(view) {
  dirty.delete(view);
}

function renderFrame() {
  frameRequested = false;
  for (const [view, text] of dirty) view.setText(text, false);
  dirty.clear();
  followStream();
}

// ---------------------------------------------------------------- following the latest line

function distanceFromBottom() {
  const m = els.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight;
}

function scrollToBottom(smooth = false) {
  const m = els.messages;
  const top = m.scrollHeight - m.clientHeight;
  if (top <= 0) return;
  expectedScrollTop = top;
  if (smooth) m.scrollTo({ top, behavior: 'smooth' });
  else m.scrollTop = top;
}

function updateJump() {
  els.jump.hidden = follow || distanceFromBottom() < 40;
}

/** Keep the newest text in view unless the reader scrolled away. */
export function followStream() {
  if (follow) scrollToBottom();
  updateJump();
}

/** Jump to the latest message and follow it again. */
export function followLatest(smooth = false) {
  follow = true;
  scrollToBottom(smooth);
}

/** The jump button: back to the latest message. */
export function jump() {
  followLatest(true);
  els.jump.hidden = true;
}

/** A scroll event: near the bottom resumes following; scrolling up by the reader stops it. */
export function onScroll() {
  const top = els.messages.scrollTop;
  const ours = Math.abs(top - expectedScrollTop) < 2;
  if (distanceFromBottom() < 24) follow = true;
  else if (!ours && top < lastScrollTop) follow = false;
  lastScrollTop = top;
  updateJump();
}

/** Wheel intent to read upward wins at once, even before the next scroll event. */
export function onWheel(e) {
  if (e.deltaY < 0 && els.messages.scrollTop > 0) follow = false;
}

/** So do the keys that scroll up. */
export function onKeydown(e) {
  if (['PageUp', 'ArrowUp', 'Home'].includes(e.key)) follow = false;
}

/** The viewport or composer changed size. */
export function onResize() {
  if (follow) scrollToBottom();
}

// ---------------------------------------------------------------- copy buttons

function fallbackCopy(text) {
  // navigator.clipboard needs a secure context; plain-http deployments use this.
  const area = document.createElement('textarea');
  area.value = text;
  area.setAttribute('readonly', '');
  area.className = 'sr-only';
  document.body.append(area);
  area.select();
  try { document.execCommand('copy'); } catch { /* nothing more to try */ }
  area.remove();
}

/** A copy button (a code block's or an answer's) was pressed: copy, and say so for a moment. */
export async function copy(button) {
  let text = null;
  if (button.dataset.copy === 'code') text = codeTextFor(button);
  else if (button.dataset.action === 'copy-message') text = button.closest('.msg')?.view?.text ?? '';
  if (text === null) return;
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    fallbackCopy(text);
  }
  const label = button.querySelector('span');
  const icon = button.querySelector('svg');
  const oldLabel = label?.textContent;
  const oldIcon = icon?.outerHTML;
  button.classList.add('copied');
  if (label) label.textContent = 'Copied';
  if (icon) icon.outerHTML = ICON_CHECK;
  announce('Copied to clipboard');
  setTimeout(() => {
    button.classList.remove('copied');
    if (label) label.textContent = oldLabel;
    const now = button.querySelector('svg');
    if (now && oldIcon) now.outerHTML = oldIcon;
  }, 1500);
}

// The message list: adding and clearing messages, streaming renders batched per frame,
// following the latest line while the reader lets it (also while late layout settles:
// highlighting, tables, messages laid out only once near the view), and the copy buttons.
import { els } from './dom.js';
import { AssistantMessage, setIdentity, userMessage } from './message.js';
import { codeTextFor } from './markdown.js';
import { ICON_CHECK } from './icons.js';
import { announce } from './util.js';

let follow = true;
let anchor = null; // a revealed message kept in view while layout settles, until the reader scrolls
let lastScrollTop = 0;
let expectedScrollTop = -1;
let dragging = false; // the reader holds the scrollbar
let touchY = null;
const dirty = new Map(); // view -> its newest text, drawn at the next frame
let frameRequested = false;

// ---------------------------------------------------------------- messages

/** Add a node (a message) at the end. */
export function append(node) {
  els.empty.hidden = true;
  els.thread.append(node);
}

/** Add a user message (with its attached files); returns its element. */
export function appendUser(content, files = []) {
  const el = userMessage(content, files);
  append(el);
  return el;
}

/** The message elements, in order. */
export const messageEls = () => [...els.thread.querySelectorAll('.msg')];

/** The last message element, or undefined. */
export const lastMessage = () => messageEls().pop();

/** The element of a stored message, by id. */
export const messageEl = (id) => messageEls().find((el) => el.dataset.id === id);

/** A stored message's element: a user message, or a finished answer. */
function storedEl(m) {
  let el;
  if (m.role === 'user') {
    el = userMessage(m.content, m.attachments || []);
  } else {
    const view = new AssistantMessage();
    el = view.el;
    el.versions = m.versions;
    el.dataset.id = m.id;
    view.setText(m.content, true);
    if (m.reasoning) view.setReasoning(m.reasoning, false, m.timings?.thinking_ms);
    view.finish(m);
  }
  setIdentity(el, m);
  return el;
}

/** Put the stored ids and versions on the messages shown; false when they do not line up. */
export function applyIds(messages) {
  const shown = messageEls();
  if (shown.length !== messages.length || shown.some((el, i) => !el.classList.contains(`msg-${messages[i].role}`))) return false;
  shown.forEach((el, i) => setIdentity(el, messages[i]));
  return true;
}

/** Replace ``el`` and every message after it with ``messages`` (the new path below a version switch). */
export function replaceFrom(el, messages) {
  const shown = messageEls();
  for (const old of shown.slice(shown.indexOf(el))) old.remove();
  const fragment = document.createDocumentFragment();
  for (const m of messages) fragment.append(storedEl(m));
  els.thread.append(fragment);
  updateJump();
}

/** Scroll a message into view and flash it (a search result was opened). */
export function reveal(id) {
  const el = messageEl(id);
  if (!el) return false;
  follow = false;
  anchor = el;
  centre(el);
  el.classList.add('found');
  setTimeout(() => el.classList.remove('found'), 2000);
  return true;
}

/** Empty the thread; the welcome text shows when ``showEmpty``. */
export function reset(showEmpty) {
  for (const node of [...els.thread.children]) if (node !== els.empty) node.remove();
  els.empty.hidden = !showEmpty;
  follow = true;
  anchor = null;
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
  const fragment = document.createDocumentFragment();
  for (const m of shown) fragment.append(storedEl(m));
  els.thread.append(fragment);
  for (const req of live) {
    if (req.userEl && !shown.length) els.thread.append(req.userEl);
    els.thread.append(req.view.el);
  }
  els.empty.hidden = els.thread.querySelector('.msg') !== null;
  requestAnimationFrame(() => { follow = true; scrollToBottom(); updateJump(); });
}

/** Regenerate and Continue show on the last answer only, Edit on every user message; none
 * while ``hidden`` (an answer is streaming, or nothing is stored yet). */
export function updateRegenerate(hidden) {
  const last = lastMessage();
  for (const button of els.thread.querySelectorAll('[data-action="regenerate"], [data-action="continue"]')) {
    button.hidden = hidden || button.closest('.msg') !== last;
  }
  for (const button of els.thread.querySelectorAll('[data-action="edit"], [data-action="branch"], [data-action="edit-answer"]')) button.hidden = hidden;
}

// ---------------------------------------------------------------- streaming, one render per frame
// Each frame's render is measured (performance.measure 'chat-render') for a PerformanceObserver
// (DevTools, the tests); the timeline buffer is cleared at once so a long session keeps none.

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
  const start = performance.now();
  for (const [view, text] of dirty) view.setText(text, false);
  dirty.clear();
  followStream();
  performance.measure('chat-render', { start });
  performance.clearMeasures('chat-render');
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

function centre(el) {
  el.scrollIntoView({ block: 'center' });
  expectedScrollTop = els.messages.scrollTop;
}

/** The reader moved up: stop following and holding a revealed message. */
function readerScrolledUp() {
  follow = false;
  anchor = null;
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

/** A scroll event: near the bottom resumes following. Only the reader's own scrolling up stops
 * it (the wheel, keys, a touch, the scrollbar): content that shrinks or a layout that shifts
 * moves scrollTop too, and must not. */
export function onScroll() {
  const top = els.messages.scrollTop;
  const ours = Math.abs(top - expectedScrollTop) < 2;
  if (distanceFromBottom() < 24 && !anchor) follow = true;
  else if (!ours && dragging && top < lastScrollTop) readerScrolledUp();
  lastScrollTop = top;
  updateJump();
}

/** Wheel intent to read upward wins at once, even before the next scroll event. */
export function onWheel(e) {
  if (e.deltaY < 0 && els.messages.scrollTop > 0) readerScrolledUp();
  else if (e.deltaY > 0) anchor = null;
}

/** So do the keys that scroll up. */
export function onKeydown(e) {
  if (['PageUp', 'ArrowUp', 'Home'].includes(e.key) || (e.key === ' ' && e.shiftKey)) readerScrolledUp();
}

/** A press on the scroller itself is on its scrollbar. */
export function onPointerdown(e) {
  if (e.target === els.messages) dragging = true;
}

export function onPointerup() {
  dragging = false;
}

export function onTouchstart(e) {
  touchY = e.touches[0]?.clientY ?? null;
}

/** A finger moving down scrolls the thread up: the reader takes over, fling included. */
export function onTouchmove(e) {
  const y = e.touches[0]?.clientY;
  if (touchY !== null && y !== undefined && y > touchY + 2) readerScrolledUp();
  touchY = y ?? touchY;
}

/** The viewport, the composer or the thread's content changed size: keep the latest line (or
 * the revealed message) where the reader expects it. */
export function onResize() {
  if (follow) scrollToBottom();
  else if (anchor?.isConnected) centre(anchor);
  updateJump();
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

/** Put ``text`` on the clipboard. */
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    fallbackCopy(text);
  }
}

/** A copy button (a code block's or an answer's) was pressed: copy, and say so for a moment. */
export async function copy(button) {
  let text = null;
  if (button.dataset.copy === 'code') text = codeTextFor(button);
  else if (button.dataset.action === 'copy-message') text = button.closest('.msg')?.view?.text ?? '';
  if (text === null) return;
  await copyText(text);
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

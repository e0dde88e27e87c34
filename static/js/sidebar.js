// The conversation list: which conversations there are, which one is open, its title in the
// top bar, renaming, and the drawer it becomes on small screens.
import { els } from './dom.js';
import * as api from './api.js';
import * as requests from './requests.js';
import { showError } from './composer.js';
import { storage } from './util.js';

const KEY_CONVERSATION = 'chat.conversation';
// Titles from first messages, shown until the server's list has the conversation's own.
const KEY_TITLES = 'chat.titles';

let conversations = [];
let current = null;
const titles = storage.get(KEY_TITLES, {});
let refreshTimer = 0;

/** The open conversation's id; null for a new chat not started yet. */
export const currentId = () => current;

/** The id the page showed last time, or null. */
export function savedId() {
  const saved = storage.get(KEY_CONVERSATION, null);
  return typeof saved === 'string' && saved ? saved : null;
}

export function titleOf(id) {
  const conversation = conversations.find((c) => c.id === id);
  return (conversation?.title || '').trim() || titles[id] || 'New chat';
}

/** Fetch the list again; quietly keeps the old one when the server cannot be reached. */
export async function refresh() {
  let list;
  try { list = await api.listConversations(); } catch { return; }
  const known = new Set(list.map((c) => c.id));
  // Keep a conversation that started a moment ago but is not listed yet.
  const pending = conversations.filter((c) => !known.has(c.id) && requests.all().some((r) => r.conversationId === c.id));
  conversations = [...pending, ...list];
  render();
}

/** Refresh a little later, once for a burst of changes. */
export function refreshSoon() {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refresh, 300);
}

/** A conversation the server just created for a first message ``content``. */
export function added(id, content) {
  if (!titles[id] && content) {
    titles[id] = content.slice(0, 80);
    storage.set(KEY_TITLES, titles);
  }
  if (!conversations.some((c) => c.id === id)) conversations.unshift({ id, title: '' });
}

/** The server's title for a conversation, from its full record. */
export function setTitle(id, title) {
  const entry = conversations.find((c) => c.id === id);
  if (entry) entry.title = title;
  updateHeader();
}

/** Drop a deleted (or vanished) conversation from the list. */
export function forget(id) {
  conversations = conversations.filter((c) => c.id !== id);
  delete titles[id];
  storage.set(KEY_TITLES, titles);
  render();
}

/** Make ``id`` the open conversation (null: a new chat), remembered across reloads. */
export function setCurrent(id) {
  current = id;
  if (id) storage.set(KEY_CONVERSATION, id);
  else storage.remove(KEY_CONVERSATION);
  for (const item of els.list.children) {
    const isCurrent = item.dataset.id === id;
    item.setAttribute('aria-current', isCurrent ? 'true' : 'false');
    const open = item.querySelector('.conversation-open');
    if (isCurrent) open.setAttribute('aria-current', 'page');
    else open.removeAttribute('aria-current');
  }
  updateHeader();
}

function item(c) {
  const li = els.tplConversation.content.firstElementChild.cloneNode(true);
  li.dataset.id = c.id;
  const isCurrent = c.id === current;
  li.setAttribute('aria-current', isCurrent ? 'true' : 'false');
  const title = titleOf(c.id);
  li.querySelector('.conversation-title').textContent = title;
  const open = li.querySelector('.conversation-open');
  open.title = title;
  if (isCurrent) open.setAttribute('aria-current', 'page');
  li.querySelector('[data-action="rename"]').setAttribute('aria-label', `Rename “${title}”`);
  li.querySelector('[data-action="delete"]').setAttribute('aria-label', `Delete “${title}”`);
  const exp = li.querySelector('[data-action="export"]');
  exp.href = api.exportUrl(c.id, 'md');
  exp.setAttribute('aria-label', `Export “${title}” as Markdown`);
  return li;
}

const focusItem = (id) => els.list.querySelector(`[data-id="${CSS.escape(id)}"] .conversation-open`)?.focus();

export function render() {
  if (els.list.querySelector('.conversation-rename')) return; // do not pull the field away from someone typing
  const focusedId = document.activeElement?.closest?.('.conversation')?.dataset.id;
  els.list.replaceChildren(...conversations.map(item));
  els.listEmpty.hidden = conversations.length > 0;
  if (focusedId) focusItem(focusedId);
  updateHeader();
}

/** The top bar: the open conversation's title and its export links. */
export function updateHeader() {
  const title = current ? titleOf(current) : 'New chat';
  els.title.textContent = title;
  document.title = current ? `${title} · Chat` : 'Chat';
  els.exportMenu.hidden = !current;
  if (current) {
    els.exportMd.href = api.exportUrl(current, 'md');
    els.exportJson.href = api.exportUrl(current, 'json');
  }
}

/** Turn a list item into a title field; Enter or leaving it saves, Esc cancels. */
export function startRename(li) {
  const id = li.dataset.id;
  const input = document.createElement('input');
  input.className = 'conversation-rename';
  input.value = titleOf(id);
  input.maxLength = 200;
  input.setAttribute('aria-label', 'New title');
  li.querySelector('.conversation-open').hidden = true;
  li.querySelector('.conversation-actions').hidden = true;
  li.prepend(input);
  input.focus();
  input.select();
  let finished = false;
  const finish = async (save) => {
    if (finished) return;
    finished = true;
    const title = input.value.trim();
    input.remove();
    if (save && title && title !== titleOf(id)) {
      const conversation = conversations.find((c) => c.id === id);
      if (conversation) conversation.title = title;
      try {
        await api.renameConversation(id, title);
      } catch (err) {
        showError(`Could not rename: ${err.message}`);
      }
    }
    render();
    focusItem(id);
  };
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.isComposing && e.keyCode !== 229) { e.preventDefault(); finish(true); }
    if (e.key === 'Escape') { e.preventDefault(); e.stopPropagation(); finish(false); }
  });
  input.addEventListener('blur', () => finish(true));
}

// ---------------------------------------------------------------- the drawer on small screens

export const drawerOpen = () => els.app.classList.contains('sidebar-open');

export function openDrawer() {
  els.app.classList.add('sidebar-open');
  els.scrim.hidden = false;
  els.sidebarToggle.setAttribute('aria-expanded', 'true');
  els.newChat.focus();
}

export function closeDrawer() {
  if (!drawerOpen()) return;
  els.app.classList.remove('sidebar-open');
  els.scrim.hidden = true;
  els.sidebarToggle.setAttribute('aria-expanded', 'false');
  if (els.sidebar.contains(document.activeElement)) els.sidebarToggle.focus();
}

export function toggleDrawer() {
  if (drawerOpen()) closeDrawer();
  else openDrawer();
}

// The conversation list: which conversations there are (pinned first, then by date), which one
// is open, its title in the top bar, renaming and pinning, and the drawer it becomes on small screens.
import { els } from './dom.js';
import * as api from './api.js';
import * as requests from './requests.js';
import { showError } from './composer.js';
import { storage } from './util.js';

// Titles from first messages, shown until the server's list has the conversation's own.
const KEY_TITLES = 'chat.titles';

let conversations = [];
let current = null;
const titles = storage.get(KEY_TITLES, {});
let refreshTimer = 0;
let selecting = false; // Select: a click on a row ticks it instead of opening it
const selected = new Set(); // the rows ticked

/** The open conversation's id; null for a new chat not started yet. */
export const currentId = () => current;

const offList = new Map(); // records of conversations opened but not listed (archived ones)

export function titleOf(id) {
  const conversation = conversations.find((c) => c.id === id) || offList.get(id);
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
  const now = Date.now() / 1000;
  if (!conversations.some((c) => c.id === id)) conversations.unshift({ id, title: '', updated_at: now, pinned: false });
}

/** The server's record of a conversation (title, pin, settings), from a GET or a PATCH. */
export function setEntry(record) {
  const entry = conversations.find((c) => c.id === record.id);
  const { messages, ...fields } = record;
  if (entry) Object.assign(entry, fields);
  else offList.set(record.id, fields);
  updateHeader();
}

/** The model wrote conversation ``id``'s title (a `title` frame): the list and the top bar show it. */
export function retitle(id, title) {
  const entry = conversations.find((c) => c.id === id);
  if (entry) entry.title = title;
  titles[id] = title;
  storage.set(KEY_TITLES, titles);
  render();
  updateHeader();
}

/** Whether rows are being ticked (Select), and which. */
export const isSelecting = () => selecting;
export const selectedIds = () => conversations.map((c) => c.id).filter((id) => selected.has(id));

/** Start or end ticking rows (ending forgets the ticks). */
export function setSelecting(on) {
  selecting = on;
  if (!on) selected.clear();
  els.selectMode.setAttribute('aria-pressed', String(on));
  els.selectModeText.textContent = on ? 'Cancel' : 'Select';
  render();
}

/** Tick or untick row ``id``. */
export function toggleSelected(id) {
  if (selected.has(id)) selected.delete(id);
  else selected.add(id);
  render();
}

/** Drop a deleted (or vanished) conversation from the list. */
export function forget(id) {
  selected.delete(id);
  conversations = conversations.filter((c) => c.id !== id);
  delete titles[id];
  storage.set(KEY_TITLES, titles);
  render();
}

/** Make ``id`` the open conversation (null: a new chat); the address keeps it across reloads. */
export function setCurrent(id) {
  current = id;
  for (const item of els.list.querySelectorAll('.conversation')) {
    const isCurrent = item.dataset.id === id;
    item.setAttribute('aria-current', isCurrent ? 'true' : 'false');
    const open = item.querySelector('.conversation-open');
    if (isCurrent) open.setAttribute('aria-current', 'page');
    else open.removeAttribute('aria-current');
  }
  if (!els.list.contains(document.activeElement)) rove();
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
  const busy = answering(c.id);
  li.classList.toggle('answering', busy);
  li.querySelector('.conversation-state .sr-only').textContent = busy ? ' (answering)' : '';
  li.classList.toggle('pinned', Boolean(c.pinned));
  li.dataset.pinned = c.pinned ? 'true' : 'false';
  li.querySelector('[data-action="menu"]').setAttribute('aria-label', `Actions for “${title}”`);
  if (selecting) {
    open.setAttribute('role', 'checkbox');
    open.setAttribute('aria-checked', String(selected.has(c.id)));
    li.classList.add('selectable');
    li.classList.toggle('selected', selected.has(c.id));
  }
  return li;
}

// Conversations another tab of this person is answering in (word from tabs.js).
const elsewhere = new Set();

/** Whether an answer is being written in conversation ``id``: in this tab, another (word from
 * tabs.js), or anywhere as the list last said. */
const answering = (id) => elsewhere.has(id) || requests.all().some((r) => r.conversationId === id)
  || Boolean(conversations.find((c) => c.id === id)?.answering);

/** Another tab started (true) or ended (false) an answer in ``id``. */
export function answeringElsewhere(id, on) {
  if (on) elsewhere.add(id);
  else elsewhere.delete(id);
  render();
}

/** The list is one Tab stop: the row ``id`` (else the open conversation's, else the first) holds it. */
export function rove(id = null) {
  const rows = [...els.list.querySelectorAll('.conversation-open')];
  const target = rows.find((b) => b.closest('.conversation').dataset.id === id)
    || rows.find((b) => b.closest('.conversation').dataset.id === current) || rows[0];
  for (const b of rows) b.tabIndex = b === target ? 0 : -1;
  return target;
}

const focusItem = (id) => rove(id)?.focus();

const DAY_MS = 86400000;

/** The sidebar group of a conversation: Pinned, then by the day it last changed. */
function groupOf(c, today) {
  if (c.pinned) return 'Pinned';
  const at = (c.updated_at || 0) * 1000;
  if (at >= today) return 'Today';
  if (at >= today - DAY_MS) return 'Yesterday';
  if (at >= today - 7 * DAY_MS) return 'Previous 7 days';
  return 'Older';
}

/** The conversations under their group headings, in the server's order (pinned first, newest first). */
function grouped() {
  const midnight = new Date();
  midnight.setHours(0, 0, 0, 0);
  const groups = new Map();
  for (const c of conversations) {
    const name = groupOf(c, midnight.getTime());
    if (!groups.has(name)) groups.set(name, []);
    groups.get(name).push(c);
  }
  return [...groups].map(([name, list]) => {
    const li = document.createElement('li');
    li.className = 'conversation-group';
    li.dataset.testid = 'conversation-group';
    const heading = document.createElement('h3');
    heading.className = 'group-title';
    heading.textContent = name;
    const ul = document.createElement('ul');
    ul.setAttribute('aria-label', name);
    ul.append(...list.map(item));
    li.append(heading, ul);
    return li;
  });
}

/** Pin or unpin a conversation; the list moves it at once and follows the server's answer. */
export async function togglePin(id) {
  const entry = conversations.find((c) => c.id === id);
  if (!entry) return;
  entry.pinned = !entry.pinned;
  render();
  try {
    setEntry(await api.updateConversation(id, { pinned: entry.pinned }));
  } catch (err) {
    entry.pinned = !entry.pinned;
    showError(`Could not ${entry.pinned ? 'unpin' : 'pin'}: ${err.message}`);
  }
  await refresh();
  focusItem(id);
}

export function render() {
  if (els.list.querySelector('.conversation-rename')) return; // do not pull the field away from someone typing
  const focusedId = document.activeElement?.closest?.('.conversation')?.dataset.id;
  const onMore = document.activeElement?.classList?.contains('conversation-more');
  // Pinned first, keeping the order within each part (a pin shows at once, before the server's list).
  conversations = [...conversations.filter((c) => c.pinned), ...conversations.filter((c) => !c.pinned)];
  els.list.replaceChildren(...grouped());
  els.listEmpty.hidden = conversations.length > 0;
  els.list.classList.toggle('selecting', selecting);
  els.bulkBar.hidden = !selecting;
  const ticked = selectedIds().length;
  els.bulkCount.textContent = ticked ? `${ticked} selected` : 'None selected';
  for (const b of els.bulkBar.querySelectorAll('button')) b.disabled = !ticked;
  if (focusedId) {
    focusItem(focusedId);
    if (onMore) els.list.querySelector(`[data-id="${CSS.escape(focusedId)}"] .conversation-more`)?.focus();
  } else {
    rove();
  }
  updateHeader();
}

/** The server's record of a listed conversation (title, pinned, system, params, model), or undefined. */
export const entry = (id) => conversations.find((c) => c.id === id);

/** The top bar: the open conversation's title and its export links. */
export function updateHeader() {
  const title = current ? titleOf(current) : 'New chat';
  els.title.textContent = title;
  els.title.title = title; // the whole title on hover where it is cut short
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
  li.querySelector('.conversation-more').hidden = true;
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
        setEntry(await api.updateConversation(id, { title }));
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

// While the drawer is open the rest of the page is inert (no focus, hidden from screen readers)
// and Tab wraps around inside the drawer.
export function openDrawer() {
  els.app.classList.add('sidebar-open');
  els.scrim.hidden = false;
  els.sidebarToggle.setAttribute('aria-expanded', 'true');
  els.main.inert = true;
  els.sidebar.addEventListener('keydown', trapTab);
  els.newChat.focus();
}

export function closeDrawer() {
  if (!drawerOpen()) return;
  els.app.classList.remove('sidebar-open');
  els.scrim.hidden = true;
  els.sidebarToggle.setAttribute('aria-expanded', 'false');
  els.main.inert = false;
  els.sidebar.removeEventListener('keydown', trapTab);
  if (els.sidebar.contains(document.activeElement) || document.activeElement === document.body) els.sidebarToggle.focus();
}

function trapTab(e) {
  if (e.key !== 'Tab') return;
  const focusable = [...els.sidebar.querySelectorAll('button, a[href], input, [tabindex="0"]')]
    .filter((el) => !el.disabled && el.tabIndex >= 0 && el.getClientRects().length > 0);
  const first = focusable[0];
  const last = focusable[focusable.length - 1];
  if (e.shiftKey && document.activeElement === first) {
    e.preventDefault();
    last.focus();
  } else if (!e.shiftKey && document.activeElement === last) {
    e.preventDefault();
    first.focus();
  }
}

export function toggleDrawer() {
  if (drawerOpen()) closeDrawer();
  else openDrawer();
}

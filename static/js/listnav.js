// The conversation list by keyboard: one Tab stop (a roving tabindex), arrow keys between rows,
// and each row's actions (pin, rename, export, delete) on one menu, by ⋯, → or Shift+F10.
import * as api from './api.js';
import { els } from './dom.js';
import * as sidebar from './sidebar.js';

let menuId = null; // the conversation whose menu is open (its row may be drawn again meanwhile)

const rowOf = (id) => (id ? els.list.querySelector(`.conversation[data-id="${CSS.escape(id)}"]`) : null);

const rows = () => [...els.list.querySelectorAll('.conversation-open')].filter((b) => !b.hidden);
const items = () => [...els.rowMenu.querySelectorAll('[role="menuitem"]')];

function focusRow(button) {
  if (!button) return;
  sidebar.rove(button.closest('.conversation').dataset.id);
  button.focus();
  button.scrollIntoView({ block: 'nearest' });
}

/** Open the actions menu of row ``li`` (from its ⋯ button), focusing its first item. */
export function openMenu(li, { focus = true } = {}) {
  closeMenu(false);
  const id = li.dataset.id;
  menuId = id;
  const title = sidebar.titleOf(id);
  const pinned = li.dataset.pinned === 'true';
  const [pin, , exp] = items(); // their names are their text; the menu's own names the chat
  pin.textContent = pinned ? 'Unpin' : 'Pin';
  exp.href = api.exportUrl(id, 'md');
  els.rowMenu.dataset.id = id;
  els.rowMenu.setAttribute('aria-label', `Actions for “${title}”`);
  const more = li.querySelector('.conversation-more');
  more.setAttribute('aria-expanded', 'true');
  els.rowMenu.hidden = false;
  // Under the ⋯ button, kept inside the window.
  const at = more.getBoundingClientRect();
  const box = els.rowMenu.getBoundingClientRect();
  els.rowMenu.style.left = `${Math.max(8, Math.min(at.right - box.width, innerWidth - box.width - 8))}px`;
  const below = at.bottom + 4;
  els.rowMenu.style.top = `${below + box.height > innerHeight - 8 ? Math.max(8, at.top - box.height - 4) : below}px`;
  if (focus) items()[0].focus();
}

/** Close the menu; with ``refocus`` the keyboard goes back to its row. */
export function closeMenu(refocus = true) {
  if (!menuId) return;
  const row = rowOf(menuId);
  menuId = null;
  els.rowMenu.hidden = true;
  row?.querySelector('.conversation-more')?.setAttribute('aria-expanded', 'false');
  if (refocus && row) focusRow(row.querySelector('.conversation-open'));
}

export const menuOpen = () => menuId !== null;

/** Keys on the list: ↑/↓/Home/End between rows, →/Shift+F10/ContextMenu the row's menu,
 * ← back from ⋯ to its row, F2 rename, Delete delete (``act(action, li)`` does those two). */
export function onListKeydown(e, act) {
  if (e.target.closest('.conversation-rename')) return;
  const li = e.target.closest('.conversation');
  if (!li) return;
  const list = rows();
  const at = list.indexOf(li.querySelector('.conversation-open'));
  const onMore = e.target.classList.contains('conversation-more');
  let handled = true;
  if (e.key === 'ArrowDown') focusRow(list[Math.min(at + 1, list.length - 1)]);
  else if (e.key === 'ArrowUp') focusRow(list[Math.max(at - 1, 0)]);
  else if (e.key === 'Home') focusRow(list[0]);
  else if (e.key === 'End') focusRow(list[list.length - 1]);
  else if (e.key === 'ArrowRight' && !onMore) li.querySelector('.conversation-more').focus();
  else if (e.key === 'ArrowLeft' && onMore) focusRow(li.querySelector('.conversation-open'));
  else if ((e.key === 'F10' && e.shiftKey) || e.key === 'ContextMenu') openMenu(li);
  else if (e.key === 'F2') act('rename', li);
  else if (e.key === 'Delete') act('delete', li);
  else handled = false;
  if (handled) e.preventDefault();
}

/** Keys in the menu: ↑/↓/Home/End between items, Esc or Tab closes it. */
export function onMenuKeydown(e) {
  const list = items();
  const at = list.indexOf(document.activeElement);
  let handled = true;
  if (e.key === 'ArrowDown') list[(at + 1) % list.length].focus();
  else if (e.key === 'ArrowUp') list[(at - 1 + list.length) % list.length].focus();
  else if (e.key === 'Home') list[0].focus();
  else if (e.key === 'End') list[list.length - 1].focus();
  else if (e.key === 'Escape') { e.stopPropagation(); closeMenu(); }
  else if (e.key === 'Tab') { closeMenu(false); handled = false; }
  else handled = false;
  if (handled) e.preventDefault();
}

/** The row the open menu belongs to (for its actions), or null. */
export const menuTarget = () => rowOf(menuId);

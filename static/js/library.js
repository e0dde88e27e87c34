// Nothing deleted by one slip: Delete moves chats to the trash with an Undo toast, Archive takes them
// out of the list whole, the Archived and Trash lists bring them back, and Select ticks several
// chats to archive, delete or export at once.
import * as api from './api.js';
import * as chat from './chat.js';
import { showError } from './composer.js';
import { els } from './dom.js';
import * as requests from './requests.js';
import * as sidebar from './sidebar.js';
import * as socket from './socket.js';
import * as tabs from './tabs.js';
import { announce } from './util.js';

const TOAST_MS = 10000; // how long Undo is offered (longer while the toast has the keyboard or the pointer)
let toastTimer = 0;
let undoAction = null;
let shownView = null; // the library dialog's list: 'archived' or 'trash'

/** Say ``text`` in the toast at the bottom of the page, with Undo when ``undo`` is given. */
export function toast(text, undo = null) {
  clearTimeout(toastTimer);
  els.toastText.textContent = text;
  undoAction = undo;
  els.toastUndo.hidden = !undo;
  els.toast.hidden = false;
  toastTimer = setTimeout(hideToast, TOAST_MS);
}

function hideToast() {
  if (els.toast.contains(document.activeElement) || els.toast.matches(':hover')) {
    toastTimer = setTimeout(hideToast, 2000);
    return;
  }
  els.toast.hidden = true;
  undoAction = null;
}

/** Undo what the toast says (a delete or an archive). */
export async function undo() {
  const action = undoAction;
  undoAction = null;
  clearTimeout(toastTimer);
  els.toast.hidden = true;
  if (!action) return;
  try {
    await action();
  } catch (err) {
    showError(`Could not undo: ${err.message}`);
  }
}

/** Conversations that left the list: their answers are cancelled; the open one gives way to a new chat. */
function leave(ids) {
  for (const id of ids) {
    for (const req of requests.activeIn(id)) socket.send({ type: 'cancel', id: req.id });
    chat.forgetConversation(id);
    tabs.tell('deleted', id);
  }
}

/** Back in the list (Undo, Restore, Unarchive): the list again, and the chat that was open opens. */
async function back(ids, reopen) {
  await sidebar.refresh();
  for (const id of ids) tabs.tell('restored', id);
  if (reopen && ids.includes(reopen) && !sidebar.currentId()) chat.openConversation(reopen);
}

const named = (ids, titles, what) => (ids.length === 1 ? `“${titles[0]}” ${what}.` : `${ids.length} chats ${what}.`);

/** ``action`` ('trash' or 'archive') on the chats ``ids``, with Undo. */
async function takeOut(action, ids) {
  if (!ids.length) return;
  const open = sidebar.currentId();
  const titles = ids.map((id) => sidebar.titleOf(id));
  for (const id of ids) for (const req of requests.activeIn(id)) socket.send({ type: 'cancel', id: req.id });
  let done = ids;
  let forever = false;
  try {
    if (action === 'trash' && ids.length === 1) {
      forever = !(await api.deleteConversation(ids[0])).trash;
    } else {
      const answer = await api.bulk(action, ids);
      done = answer.ids;
      forever = answer.action === 'delete';
    }
  } catch (err) {
    if (err.status !== 404) {
      showError(`Could not ${action === 'trash' ? 'delete' : 'archive'}: ${err.message}`);
      return;
    }
  }
  leave(done);
  if (!done.length) return;
  if (forever) {
    toast(named(done, titles, 'deleted'));
    announce(named(done, titles, 'deleted'));
    return;
  }
  const said = named(done, titles, action === 'trash' ? 'moved to the trash' : 'archived');
  announce(`${said} Undo is in the toast at the bottom.`);
  toast(said, async () => {
    await api.bulk(action === 'trash' ? 'restore' : 'unarchive', done);
    await back(done, open);
    announce(done.length === 1 ? 'Chat restored.' : `${done.length} chats restored.`);
  });
}

/** Delete: to the trash, with Undo (for good at once where the server keeps no trash). */
export const trash = (ids) => takeOut('trash', ids);
/** Archive: out of the list, whole, with Undo. */
export const archive = (ids) => takeOut('archive', ids);

// ---------------------------------------------------------------- Select

/** Start or end Select (ticking rows); the keyboard stays on the button. */
export function toggleSelect() {
  sidebar.setSelecting(!sidebar.isSelecting());
}

/** What the bulk bar's buttons do to the ticked chats. */
export async function onBulk(action) {
  const ids = sidebar.selectedIds();
  if (!ids.length) return;
  if (action === 'export') {
    try {
      const { blob, name } = await api.exportSeveral(ids);
      const link = document.createElement('a');
      link.href = URL.createObjectURL(blob);
      link.download = name;
      link.click();
      setTimeout(() => URL.revokeObjectURL(link.href), 10000);
      toast(`${ids.length} ${ids.length === 1 ? 'chat' : 'chats'} exported as ${name}.`);
    } catch (err) {
      showError(`Could not export: ${err.message}`);
    }
    return;
  }
  sidebar.setSelecting(false);
  els.selectMode.focus();
  await (action === 'archive' ? archive(ids) : trash(ids));
}

// ---------------------------------------------------------------- the Archived and Trash lists

/** Open the list of archived chats (``view`` 'archived') or of the trash ('trash'). */
export async function openLibrary(view) {
  shownView = view;
  const days = socket.limits().trash_days;
  els.libraryTitle.textContent = view === 'trash' ? 'Trash' : 'Archived chats';
  els.libraryAbout.textContent = view === 'trash'
    ? `Deleted chats wait here${days ? ` for ${days} days` : ''}, then are deleted for good. Restore brings one back.`
    : 'Archived chats are out of the list but whole: open one to read or continue it, or put it back.';
  els.libraryStatus.textContent = '';
  els.libraryList.replaceChildren();
  if (!els.library.open) els.library.showModal();
  await showLibrary();
}

const DATE = new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'short' });

async function showLibrary() {
  let list;
  try {
    list = await api.listConversations(shownView);
  } catch (err) {
    els.libraryStatus.textContent = `Could not load the list: ${err.message}`;
    return;
  }
  const trashView = shownView === 'trash';
  els.libraryList.replaceChildren(...list.map((c) => {
    const li = document.createElement('li');
    li.className = 'library-item';
    li.dataset.testid = 'library-item';
    li.dataset.id = c.id;
    const text = document.createElement('span');
    text.className = 'library-text';
    const title = document.createElement('span');
    title.className = 'library-title';
    title.textContent = c.title || 'New chat';
    title.title = c.title || '';
    const when = document.createElement('time');
    when.className = 'library-date';
    const at = new Date((trashView ? c.deleted_at : c.updated_at) * 1000);
    when.dateTime = at.toISOString();
    when.textContent = `${trashView ? 'Deleted' : 'Last message'} ${DATE.format(at)}`;
    text.append(title, when);
    const actions = document.createElement('span');
    actions.className = 'library-actions';
    const buttons = trashView ? [['restore', 'Restore'], ['purge', 'Delete forever']] : [['open', 'Open'], ['unarchive', 'Unarchive']];
    for (const [action, label] of buttons) {
      const b = document.createElement('button');
      b.type = 'button';
      b.className = `btn-secondary small${action === 'purge' ? ' danger' : ''}`;
      b.dataset.libraryAction = action;
      b.dataset.testid = `library-${action}`;
      b.textContent = label;
      b.setAttribute('aria-label', `${label}: ${c.title || 'New chat'}`);
      actions.append(b);
    }
    li.append(text, actions);
    return li;
  }));
  els.libraryEmpty.hidden = list.length > 0;
  els.libraryEmpty.textContent = trashView ? 'The trash is empty.' : 'No archived chats.';
  els.libraryEmptyTrash.hidden = !trashView || !list.length;
}

/** A button of the library's list: open, unarchive, restore, delete forever; or Empty trash. */
export async function onLibraryClick(e) {
  const button = e.target.closest('button');
  if (!button) return;
  if (button === els.libraryEmptyTrash) {
    const ids = [...els.libraryList.querySelectorAll('.library-item')].map((li) => li.dataset.id);
    if (!ids.length || !confirm(`Delete the ${ids.length} chats in the trash for good? This cannot be undone.`)) return;
    await run(() => api.bulk('delete', ids), 'The trash is empty.');
    return;
  }
  const action = button.dataset.libraryAction;
  const id = button.closest('.library-item')?.dataset.id;
  if (!action || !id) return;
  const title = button.closest('.library-item').querySelector('.library-title').textContent;
  if (action === 'open') {
    els.library.close();
    sidebar.closeDrawer();
    chat.openConversation(id);
  } else if (action === 'unarchive') {
    await run(() => api.bulk('unarchive', [id]), `“${title}” is back in the list.`, id);
  } else if (action === 'restore') {
    await run(() => api.restoreConversation(id), `“${title}” restored.`, id);
  } else if (action === 'purge') {
    if (!confirm(`Delete “${title}” for good? This cannot be undone.`)) return;
    await run(() => api.purgeConversation(id), `“${title}” deleted for good.`);
  }
}

async function run(call, said, backId = null) {
  try {
    await call();
  } catch (err) {
    if (err.status !== 404) {
      els.libraryStatus.textContent = `Could not do that: ${err.message}`;
      return;
    }
  }
  els.libraryStatus.textContent = said;
  announce(said);
  if (backId) await back([backId], null);
  await showLibrary();
  (els.libraryList.querySelector('button') || els.library.querySelector('.btn-primary')).focus();
}

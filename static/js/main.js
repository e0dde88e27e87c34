// The chat page's entry point: every event listener is wired here, then the page starts.
import { els } from './dom.js';
import * as attachments from './attachments.js';
import * as chat from './chat.js';
import * as frames from './frames.js';
import * as listnav from './listnav.js';
import * as composer from './composer.js';
import { importFile } from './importer.js';
import * as library from './library.js';
import * as models from './models.js';
import * as router from './router.js';
import * as search from './search.js';
import * as presets from './presets.js';
import * as settings from './settings.js';
import * as share from './share.js';
import * as sidebar from './sidebar.js';
import * as socket from './socket.js';
import * as tabs from './tabs.js';
import * as thread from './thread.js';
import * as tokens from './tokens.js';

// ---------------------------------------------------------------- the thread

els.messages.addEventListener('scroll', thread.onScroll, { passive: true });
els.messages.addEventListener('wheel', thread.onWheel, { passive: true });
els.messages.addEventListener('keydown', thread.onKeydown);
els.messages.addEventListener('pointerdown', thread.onPointerdown);
document.addEventListener('pointerup', thread.onPointerup);
els.messages.addEventListener('touchstart', thread.onTouchstart, { passive: true });
els.messages.addEventListener('touchmove', thread.onTouchmove, { passive: true });
// Keep the latest line in view when the viewport or composer changes size, and while the
// thread's own content settles (code highlighted, tables laid out, far messages measured).
const resized = new ResizeObserver(thread.onResize);
resized.observe(els.messages);
resized.observe(els.thread);
els.jump.addEventListener('click', thread.jump);
// Message actions (copy, regenerate, continue, edit, versions), through one delegated listener.
const MESSAGE_ACTIONS = {
  regenerate: () => chat.regenerate(),
  continue: (msg) => chat.continueAnswer(msg.view),
  edit: (msg) => chat.edit(msg),
  branch: (msg) => chat.branchFrom(msg),
  'edit-answer': (msg) => chat.editAnswer(msg),
  'version-prev': (msg) => chat.switchVersion(msg, -1),
  'version-next': (msg) => chat.switchVersion(msg, 1),
};
els.thread.addEventListener('click', (e) => {
  const button = e.target.closest('button');
  if (!button) return;
  const action = MESSAGE_ACTIONS[button.dataset.action];
  if (action) action(button.closest('.msg'));
  else thread.copy(button);
});

// ---------------------------------------------------------------- the composer

els.prompt.addEventListener('compositionstart', () => composer.setComposing(true));
els.prompt.addEventListener('compositionend', () => composer.setComposing(false));
els.prompt.addEventListener('input', () => {
  composer.autosize();
  chat.refreshControls();
  attachments.countDraft();
});
els.prompt.addEventListener('keydown', (e) => {
  if (!composer.isSendKey(e)) return;
  e.preventDefault();
  chat.send();
});
els.composer.addEventListener('submit', (e) => {
  e.preventDefault();
  chat.send();
});
els.stop.addEventListener('click', () => {
  chat.stop();
  els.prompt.focus();
});
els.queuedCancel.addEventListener('click', () => {
  chat.cancelQueued();
  els.prompt.focus();
});

// Attachments: the button, a drop on the composer or the thread, or files pasted into the box.
els.attach.addEventListener('click', () => els.attachFile.click());
els.attachFile.addEventListener('change', () => {
  attachments.add([...els.attachFile.files]);
  els.attachFile.value = '';
});
els.attachments.addEventListener('click', (e) => {
  const index = e.target.closest('[data-remove]')?.dataset.remove;
  if (index !== undefined) attachments.remove(Number(index));
});
els.prompt.addEventListener('paste', (e) => {
  const files = [...(e.clipboardData?.files || [])];
  if (!files.length) return;
  e.preventDefault();
  attachments.add(files);
});
const hasFiles = (e) => [...(e.dataTransfer?.types || [])].includes('Files');
// A file dropped anywhere must not navigate away from the page.
document.addEventListener('dragover', (e) => { if (hasFiles(e)) e.preventDefault(); });
document.addEventListener('drop', (e) => {
  if (!hasFiles(e)) return;
  e.preventDefault();
  if (els.sidebar.contains(e.target)) importFiles([...e.dataTransfer.files]);
  else attachments.add([...e.dataTransfer.files]);
});

// Shortcuts for the whole page (listed under "?"); single keys only outside text fields.
const typing = (el) => el?.closest?.('input, textarea, select, [contenteditable="true"]');
document.addEventListener('keydown', (e) => {
  if (e.defaultPrevented || e.isComposing || els.settings.open || els.shortcuts.open || els.share.open) return;
  const mod = e.ctrlKey || e.metaKey;
  if (mod && e.shiftKey && e.key.toLowerCase() === 'o') {
    e.preventDefault();
    els.newChat.click();
  } else if ((mod && !e.shiftKey && e.key.toLowerCase() === 'k') || (e.key === '/' && !mod && !typing(e.target))) {
    e.preventDefault();
    if (!matchMedia('(min-width: 821px)').matches && !sidebar.drawerOpen()) sidebar.openDrawer();
    els.search.focus();
    els.search.select();
  } else if (e.key === '?' && !mod && !typing(e.target)) {
    e.preventDefault();
    els.shortcuts.showModal();
  } else if (e.key === 'Escape' && e.shiftKey) {
    e.preventDefault();
    sidebar.closeDrawer();
    els.prompt.focus();
  }
});
els.openShortcuts.addEventListener('click', () => els.shortcuts.showModal());
els.shortcuts.addEventListener('click', (e) => {
  if (e.target === els.shortcuts) els.shortcuts.close(); // click on the backdrop
});

// Esc closes what is open, innermost first; with nothing open it stops the answer.
document.addEventListener('keydown', (e) => {
  if (e.key !== 'Escape' || e.shiftKey || e.defaultPrevented || e.isComposing || composer.isComposing()) return;
  if (els.settings.open || els.shortcuts.open || els.share.open) return;
  if (listnav.menuOpen()) { listnav.closeMenu(); return; }
  if (els.exportMenu.open) { els.exportMenu.open = false; return; }
  if (document.activeElement === els.search && els.search.value) { search.clear(); return; }
  if (sidebar.drawerOpen()) { sidebar.closeDrawer(); return; }
  if (chat.stop()) e.preventDefault();
});
document.addEventListener('click', (e) => {
  if (els.exportMenu.open && !els.exportMenu.contains(e.target)) els.exportMenu.open = false;
});
// The conversation menu closes once a choice is made (a download does not navigate away).
els.exportMenu.querySelector('.export-menu').addEventListener('click', (e) => {
  if (e.target.closest('a, button')) els.exportMenu.open = false;
});
els.openChatSettings.addEventListener('click', chat.openChatSettings);
els.copyMarkdown.addEventListener('click', chat.copyAsMarkdown);
share.init();
tokens.init();
els.openShare.addEventListener('click', share.open);
els.shareCopy.addEventListener('click', share.copy);
els.shareStop.addEventListener('click', share.stop);
els.share.addEventListener('click', (e) => {
  if (e.target === els.share) els.share.close(); // click on the backdrop
});
els.chatInfo.addEventListener('click', chat.openChatSettings);
els.modelPicker.addEventListener('change', () => chat.pickModel(els.modelPicker.value));
els.thinkingToggle.addEventListener('click', chat.toggleThinking);

// ---------------------------------------------------------------- the sidebar

/** A row's action, from its menu or a key: rename, pin, delete, export. */
async function rowAction(action, item) {
  const id = item.dataset.id;
  if (action === 'rename') sidebar.startRename(item);
  else if (action === 'pin') sidebar.togglePin(id);
  else if (action === 'export') sidebar.closeDrawer();
  else if (action === 'delete' || action === 'archive') {
    const next = item.nextElementSibling?.dataset.id || item.previousElementSibling?.dataset.id || null;
    await (action === 'delete' ? library.trash([id]) : library.archive([id]));
    if (!sidebar.entry(id)) sidebar.rove(next)?.focus(); // gone from the list: the keyboard stays in it
    else sidebar.rove(id)?.focus();
  }
}
els.list.addEventListener('click', (e) => {
  const item = e.target.closest('.conversation');
  if (!item) return;
  if (e.target.closest('[data-action="menu"]')) {
    if (listnav.menuTarget() === item) listnav.closeMenu();
    else listnav.openMenu(item, { focus: e.detail === 0 }); // from a key: into the menu
  } else if (e.target.closest('.conversation-open') && sidebar.isSelecting()) {
    sidebar.toggleSelected(item.dataset.id);
    sidebar.rove(item.dataset.id)?.focus();
  } else if (e.target.closest('.conversation-open')) {
    if (item.dataset.id !== sidebar.currentId()) chat.openConversation(item.dataset.id);
    sidebar.closeDrawer();
    els.prompt.focus({ preventScroll: true });
  }
});
els.list.addEventListener('keydown', (e) => listnav.onListKeydown(e, rowAction));
els.rowMenu.addEventListener('keydown', listnav.onMenuKeydown);
els.rowMenu.addEventListener('click', (e) => {
  const action = e.target.closest('[data-action]')?.dataset.action;
  const item = listnav.menuTarget();
  if (!action || !item) return;
  listnav.closeMenu(action !== 'rename' && action !== 'export');
  rowAction(action, item);
});
document.addEventListener('pointerdown', (e) => {
  if (listnav.menuOpen() && !els.rowMenu.contains(e.target) && !e.target.closest('[data-action="menu"]')) {
    listnav.closeMenu(false);
  }
});
els.list.closest('.conversations').addEventListener('scroll', () => listnav.closeMenu(false), { passive: true });
// A starter prompt on the empty screen goes as the new chat's first message.
document.getElementById('starters')?.addEventListener('click', (e) => {
  const starter = e.target.closest('.starter');
  if (!starter) return;
  els.prompt.value = starter.textContent;
  composer.autosize();
  chat.refreshControls();
  chat.send();
  els.prompt.focus({ preventScroll: true });
});
// Appearance: applied at once and kept in this browser (js/theme.js).
for (const [id, key] of [['set-theme', 'theme'], ['set-text', 'text']]) {
  const select = document.getElementById(id);
  select.value = window.chatAppearance?.get()[key] || select.value;
  select.addEventListener('change', () => window.chatAppearance?.set({ [key]: select.value }));
}
els.selectMode.addEventListener('click', library.toggleSelect);
els.bulkBar.addEventListener('click', (e) => {
  const action = e.target.closest('[data-bulk]')?.dataset.bulk;
  if (action) library.onBulk(action);
});
els.toastUndo.addEventListener('click', library.undo);
els.openArchived.addEventListener('click', () => library.openLibrary('archived'));
els.openTrash.addEventListener('click', () => library.openLibrary('trash'));
els.library.addEventListener('click', (e) => {
  if (e.target === els.library) els.library.close(); // click on the backdrop
  else library.onLibraryClick(e);
});
els.newChat.addEventListener('click', () => {
  chat.openConversation(null);
  sidebar.closeDrawer();
  els.prompt.focus();
});
els.search.addEventListener('input', search.onInput);
els.search.addEventListener('keydown', search.onKeydown);
els.searchResults.addEventListener('keydown', search.onResultsKeydown);
els.searchResults.addEventListener('click', (e) => {
  const hit = e.target.closest('.search-hit');
  if (!hit) return;
  chat.openConversation(hit.dataset.conversation, { reveal: hit.dataset.message });
  sidebar.closeDrawer();
});

async function importFiles(files) {
  let id = null;
  for (const file of files) id = (await importFile(file)) || id;
  if (!id) return;
  await sidebar.refresh();
  chat.openConversation(id);
  sidebar.closeDrawer();
}
els.importButton.addEventListener('click', () => els.importFile.click());
els.importFile.addEventListener('change', () => {
  importFiles([...els.importFile.files]);
  els.importFile.value = '';
});
els.sidebarToggle.addEventListener('click', sidebar.toggleDrawer);
// A phone turned (or a window widened) past the drawer's width: no drawer, nothing left inert.
matchMedia('(min-width: 821px)').addEventListener('change', (e) => { if (e.matches) sidebar.closeDrawer(); });
els.sidebarClose.addEventListener('click', sidebar.closeDrawer);
els.scrim.addEventListener('click', sidebar.closeDrawer);

// ---------------------------------------------------------------- settings

els.settingsForm.addEventListener('input', (e) => settings.read(e.target));
els.presetPick.addEventListener('change', presets.choose);
els.presetSave.addEventListener('click', presets.save);
els.presetDelete.addEventListener('click', presets.remove);
els.presetName.addEventListener('keydown', presets.onNameKeydown);
// The dialog opened (on the defaults or on a chat): its presets as the server has them now.
new MutationObserver(() => { if (els.settings.open) presets.refresh(); })
  .observe(els.settings, { attributes: true, attributeFilter: ['open'] });
els.settingsReset.addEventListener('click', settings.reset);
els.openSettings.addEventListener('click', () => {
  sidebar.closeDrawer();
  settings.open();
});
els.settings.addEventListener('close', settings.closed);
els.settings.addEventListener('click', (e) => {
  if (e.target === els.settings) els.settings.close(); // click on the backdrop
});

// ---------------------------------------------------------------- the connection

window.addEventListener('online', socket.reconnectNow);
// Back and Forward: show the conversation in the address, without adding an entry.
window.addEventListener('popstate', () => {
  chat.openConversation(router.idFromPath(), { address: false });
  sidebar.closeDrawer();
});
document.addEventListener('visibilitychange', () => {
  if (document.visibilityState === 'visible') socket.reconnectNow();
});

// Another tab of this person started or ended an answer, or deleted a chat: the list follows,
// and the open conversation shows it (an answer live, once nothing of this tab's runs in it).
tabs.listen(({ kind, conversationId }) => {
  sidebar.answeringElsewhere(conversationId, kind === 'started');
  sidebar.refreshSoon();
  if (conversationId !== sidebar.currentId()) return;
  if (kind === 'deleted') chat.forgetConversation(conversationId);
  else chat.syncIds();
});

// ---------------------------------------------------------------- start

settings.show();
settings.showServer(socket.model(), socket.limits());
models.setModels(socket.models(), socket.model());
socket.start({ frame: frames.onFrame, closed: chat.refreshControls, server: frames.showServer });
// The conversation in the address (/c/<id>); "/" is a new chat.
const opening = router.idFromPath();
if (opening) {
  chat.adoptInflight(opening);
  chat.openConversation(opening, { address: 'replace' });
} else {
  sidebar.updateHeader();
}
sidebar.refresh();
chat.refreshControls();
if (matchMedia('(min-width: 821px)').matches) els.prompt.focus({ preventScroll: true });

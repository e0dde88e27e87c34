// The chat page's entry point: every event listener is wired here, then the page starts.
import { els } from './dom.js';
import * as chat from './chat.js';
import * as composer from './composer.js';
import * as settings from './settings.js';
import * as sidebar from './sidebar.js';
import * as socket from './socket.js';
import * as thread from './thread.js';

// ---------------------------------------------------------------- the thread

els.messages.addEventListener('scroll', thread.onScroll, { passive: true });
els.messages.addEventListener('wheel', thread.onWheel, { passive: true });
els.messages.addEventListener('keydown', thread.onKeydown);
// Keep the latest line in view when the viewport or composer changes size.
new ResizeObserver(thread.onResize).observe(els.messages);
els.jump.addEventListener('click', thread.jump);
// Copy buttons (code blocks and whole answers) and Regenerate, through one delegated listener.
els.thread.addEventListener('click', (e) => {
  const button = e.target.closest('button');
  if (button?.dataset.action === 'regenerate') chat.regenerate();
  else if (button) thread.copy(button);
});

// ---------------------------------------------------------------- the composer

els.prompt.addEventListener('compositionstart', () => composer.setComposing(true));
els.prompt.addEventListener('compositionend', () => composer.setComposing(false));
els.prompt.addEventListener('input', () => {
  composer.autosize();
  chat.refreshControls();
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

// Esc closes what is open, innermost first; with nothing open it stops the answer.
document.addEventListener('keydown', (e) => {
  if (e.key !== 'Escape' || e.defaultPrevented || e.isComposing || composer.isComposing()) return;
  if (els.settings.open) return;
  if (els.exportMenu.open) { els.exportMenu.open = false; return; }
  if (sidebar.drawerOpen()) { sidebar.closeDrawer(); return; }
  if (chat.stop()) e.preventDefault();
});
document.addEventListener('click', (e) => {
  if (els.exportMenu.open && !els.exportMenu.contains(e.target)) els.exportMenu.open = false;
});

// ---------------------------------------------------------------- the sidebar

els.list.addEventListener('click', (e) => {
  const item = e.target.closest('.conversation');
  if (!item) return;
  const action = e.target.closest('[data-action]')?.dataset.action;
  if (action === 'rename') sidebar.startRename(item);
  else if (action === 'delete') chat.deleteConversation(item.dataset.id);
  else if (action === 'export') sidebar.closeDrawer();
  else if (e.target.closest('.conversation-open')) {
    if (item.dataset.id !== sidebar.currentId()) chat.openConversation(item.dataset.id);
    sidebar.closeDrawer();
    els.prompt.focus({ preventScroll: true });
  }
});
els.newChat.addEventListener('click', () => {
  chat.openConversation(null);
  sidebar.closeDrawer();
  els.prompt.focus();
});
els.sidebarToggle.addEventListener('click', sidebar.toggleDrawer);
els.sidebarClose.addEventListener('click', sidebar.closeDrawer);
els.scrim.addEventListener('click', sidebar.closeDrawer);

// ---------------------------------------------------------------- settings

els.settingsForm.addEventListener('input', (e) => settings.read(e.target));
els.settingsReset.addEventListener('click', settings.reset);
els.openSettings.addEventListener('click', () => {
  sidebar.closeDrawer();
  settings.open();
});
els.settings.addEventListener('click', (e) => {
  if (e.target === els.settings) els.settings.close(); // click on the backdrop
});

// ---------------------------------------------------------------- the connection

window.addEventListener('online', socket.reconnectNow);
document.addEventListener('visibilitychange', () => {
  if (document.visibilityState === 'visible') socket.reconnectNow();
});

// ---------------------------------------------------------------- start

settings.show();
settings.showServer(socket.model(), socket.limits());
socket.start({ frame: chat.onFrame, closed: chat.refreshControls });
const saved = sidebar.savedId();
if (saved) {
  chat.adoptInflight(saved);
  chat.openConversation(saved);
} else {
  sidebar.updateHeader();
}
sidebar.refresh();
chat.refreshControls();
if (matchMedia('(min-width: 821px)').matches) els.prompt.focus({ preventScroll: true });

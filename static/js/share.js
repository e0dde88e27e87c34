// Read-only links to the open conversation (when the server has CHAT_SHARING on): make one, copy
// it, stop sharing.
import { els } from './dom.js';
import * as sidebar from './sidebar.js';
import { copyText } from './thread.js';
import { announce } from './util.js';

const enabled = document.body.dataset.sharing === 'on';
let sharing = null; // the conversation the dialog is about

async function call(id, method) {
  const init = { method, credentials: 'same-origin', headers: { Accept: 'application/json' } };
  if (method === 'POST') { // every /api write is JSON (a page elsewhere cannot send one unasked)
    init.body = '{}';
    init.headers['Content-Type'] = 'application/json';
  }
  const res = await fetch(`/api/conversations/${encodeURIComponent(id)}/share`, init);
  const body = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(body.error?.message || `${res.status} ${res.statusText}`);
  return body;
}

const absolute = (path) => new URL(path, location.origin).href;

/** Show Share link… in the conversation menu only where the server allows links. */
export function init() {
  els.openShare.hidden = !enabled;
}

/** Make (or fetch) the open conversation's link and show it in the dialog. */
export async function open() {
  const id = sidebar.currentId();
  if (!enabled || !id) return;
  sharing = id;
  els.shareUrl.value = '';
  els.shareStatus.textContent = 'Making the link…';
  els.shareStop.disabled = true;
  els.share.showModal();
  try {
    const { url } = await call(id, 'POST');
    if (sharing !== id) return;
    els.shareUrl.value = absolute(url);
    els.shareStatus.textContent = '';
    els.shareStop.disabled = false;
    els.shareUrl.select();
  } catch (err) {
    els.shareStatus.textContent = `Could not make a link: ${err.message}`;
  }
}

export async function copy() {
  if (!els.shareUrl.value) return;
  await copyText(els.shareUrl.value);
  els.shareStatus.textContent = 'Link copied.';
  announce('Link copied.');
}

/** Revoke the link: it stops working at once; sharing again makes a new one. */
export async function stop() {
  if (!sharing) return;
  try {
    await call(sharing, 'DELETE');
    els.shareUrl.value = '';
    els.shareStop.disabled = true;
    els.shareStatus.textContent = 'Not shared any more: the link no longer works.';
    announce('Stopped sharing.');
  } catch (err) {
    els.shareStatus.textContent = `Could not stop sharing: ${err.message}`;
  }
}

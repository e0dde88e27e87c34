// Presets in the settings dialog: a client's named system prompt and sampling settings, kept on
// the server (/api/presets). Choosing one sets the dialog's scope (a chat, or new chats) to it.
import { els } from './dom.js';
import * as settings from './settings.js';

let presets = [];

async function call(path, method = 'GET', json) {
  const init = { method, credentials: 'same-origin', headers: { Accept: 'application/json' } };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers['Content-Type'] = 'application/json';
  }
  const res = await fetch(path, init);
  const body = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(body.error?.message || `${res.status} ${res.statusText}`);
  return body;
}

const help = (text) => { els.presetHelp.textContent = text; };

function render(selected = '') {
  const options = presets.map((p) => {
    const option = document.createElement('option');
    option.value = p.id;
    option.textContent = p.name;
    return option;
  });
  const none = document.createElement('option');
  none.value = '';
  none.textContent = presets.length ? 'None chosen' : 'No presets yet';
  els.presetPick.replaceChildren(none, ...options);
  els.presetPick.value = selected;
  els.presetDelete.hidden = !selected;
}

/** The dialog opened: none chosen yet, and the list fetched again (another tab may have changed
 * it), keeping a choice made meanwhile. */
export async function refresh() {
  els.presetPick.value = '';
  els.presetDelete.hidden = true;
  try {
    presets = await call('/api/presets');
    const picked = els.presetPick.value;
    render(presets.some((p) => p.id === picked) ? picked : '');
  } catch (err) {
    help(`Could not load presets: ${err.message}`);
  }
}

/** A preset was chosen: the dialog's scope takes its settings. */
export function choose() {
  const preset = presets.find((p) => p.id === els.presetPick.value);
  els.presetDelete.hidden = !preset;
  if (!preset) return;
  settings.apply(preset);
  help(`“${preset.name}” is set.`);
}

/** Save what the dialog holds under the typed name. */
export async function save() {
  const name = els.presetName.value.trim();
  if (!name) {
    help('Type a name for the preset first.');
    els.presetName.focus();
    return;
  }
  try {
    const preset = await call('/api/presets', 'POST', { name, ...settings.currentChoice() });
    presets.push(preset);
    els.presetName.value = '';
    render(preset.id);
    help(`Saved as “${preset.name}”.`);
  } catch (err) {
    help(`Not saved: ${err.message}`);
  }
}

export async function remove() {
  const preset = presets.find((p) => p.id === els.presetPick.value);
  if (!preset || !confirm(`Delete the preset “${preset.name}”? Chats that use its settings keep them.`)) return;
  try {
    await call(`/api/presets/${encodeURIComponent(preset.id)}`, 'DELETE');
    presets = presets.filter((p) => p !== preset);
    render();
    help(`“${preset.name}” is deleted.`);
    els.presetPick.focus();
  } catch (err) {
    help(`Could not delete: ${err.message}`);
  }
}

/** Enter in the name field saves the preset (it must not submit, and so close, the dialog). */
export function onNameKeydown(e) {
  if (e.key !== 'Enter' || e.isComposing) return;
  e.preventDefault();
  save();
}

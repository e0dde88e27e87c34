// The model picker in the top bar: the models `ready` lists, the one the open conversation uses,
// and the one a new chat will use (remembered in the browser). With one model it stays hidden.
import { els } from './dom.js';
import { storage } from './util.js';

const KEY_MODEL = 'chat.model';

let models = [];
let fallback = '';

/** Whether there is a choice to make. */
export const several = () => models.length > 1;

/** The model a new chat uses: the one picked last, if the server still serves it. */
export function forNewChat() {
  const picked = storage.get(KEY_MODEL, null);
  return models.includes(picked) ? picked : fallback;
}

/** The models the server serves, its default first (from `ready`). */
export function setModels(list, defaultModel) {
  models = Array.isArray(list) && list.length ? list.filter((m) => typeof m === 'string') : [defaultModel].filter(Boolean);
  fallback = defaultModel || models[0] || '';
  els.modelPicker.replaceChildren(...models.map((m) => new Option(m, m)));
  els.modelPicker.hidden = !several();
  els.modelName.hidden = several();
}

/** Select what ``conversation`` uses (null: a new chat); a model no longer served shows the default. */
export function showFor(conversation) {
  if (!several()) return;
  const model = conversation ? conversation.model : forNewChat();
  els.modelPicker.value = models.includes(model) ? model : fallback;
  els.modelPicker.title = conversation ? 'Model of this conversation' : 'Model for the new chat';
}

/** The picker changed with no conversation open: the next new chat uses it. */
export function rememberForNewChat(model) {
  storage.set(KEY_MODEL, model);
}

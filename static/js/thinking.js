// The thinking switch in the top bar, shown when the model thinks (`ready.thinking`): on by default. A new
// chat takes the one set last (kept in the browser) and keeps it as its own setting (`enable_thinking` in its
// params); an open conversation shows and changes its own.
import { els } from './dom.js';
import { storage } from './util.js';

const KEY = 'chat.thinking';
let offered = false;

/** Whether the model thinks (from `ready`): the switch shows. */
export function setOffered(yes) {
  offered = Boolean(yes);
  els.thinkingToggle.hidden = !offered;
}

export const isOffered = () => offered;

/** Whether the switch is on for ``conversation`` (null: a new chat). */
export const isOn = (conversation) => (conversation
  ? conversation.params?.enable_thinking !== false
  : storage.get(KEY, true) !== false);

/** Show the switch for ``conversation`` (null: a new chat). */
export function showFor(conversation) {
  const on = isOn(conversation);
  els.thinkingToggle.setAttribute('aria-pressed', String(on));
  els.thinkingToggle.dataset.on = String(on);
  els.thinkingText.textContent = on ? 'Thinking on' : 'Thinking off';
  els.thinkingToggle.title = `${on ? 'The model thinks before it answers' : 'The model answers without thinking'}`
    + (conversation ? ' in this chat' : ' in a new chat') + ': click to change';
}

/** The switch changed with no conversation open: new chats use it. */
export function rememberForNewChat(on) {
  storage.set(KEY, on);
}

/** ``params`` with the switch for a turn that sends them (a new chat's become its own settings). */
export function withSwitch(params, conversation) {
  if (!offered) return params;
  return { ...(params || {}), enable_thinking: isOn(conversation) };
}

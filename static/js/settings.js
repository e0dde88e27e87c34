// The settings dialog, in two scopes: the defaults for new chats (kept in the browser), and one
// conversation's own settings (kept on the server with it). Also what the server said about its model.
import { els } from './dom.js';
import { storage } from './util.js';

const KEY_SETTINGS = 'chat.settings';
// null means "not set": the server's default applies and nothing is sent.
const DEFAULTS = { system: '', temperature: null, top_p: null, max_new_tokens: null, seed: null };
const SLIDER_DEFAULTS = { temperature: 0.7, top_p: 0.9 };
const PARAMS = ['temperature', 'top_p', 'max_new_tokens', 'seed'];
const SAVE_DELAY_MS = 400;

/** A whole number from ``low`` to ``high`` typed in ``input`` (empty: null), else undefined. */
function wholeNumber(input, low, high) {
  if (input.validity.badInput) return undefined;
  const raw = input.value.trim();
  if (raw === '') return null;
  const value = Number(raw);
  return Number.isSafeInteger(value) && value >= low && value <= high ? value : undefined;
}

const tokenCap = () => Number(els.setMaxTokens.max) || Number.MAX_SAFE_INTEGER;

// How each field of the form becomes a setting; undefined: out of range, said beside the field.
const PARSE = {
  system: (input) => input.value,
  temperature: (input) => Number(input.value),
  top_p: (input) => Math.max(0.05, Number(input.value)),
  max_new_tokens: (input) => wholeNumber(input, 1, tokenCap()),
  seed: (input) => wholeNumber(input, 0, Number.MAX_SAFE_INTEGER),
};
const PROBLEMS = {
  max_new_tokens: () => (Number(els.setMaxTokens.max)
    ? `Enter a whole number from 1 to ${tokenCap().toLocaleString()}, or leave it empty. Not saved.`
    : 'Enter a whole number of at least 1, or leave it empty. Not saved.'),
  seed: () => 'Enter a whole number, 0 or more, or leave it empty. Not saved.',
};
const ERROR_ELS = { max_new_tokens: () => els.maxTokensError, seed: () => els.seedError };

/** Say (or stop saying) beside field ``name`` that what it holds is out of range. */
function fieldProblem(input, text) {
  const target = ERROR_ELS[input.name]?.();
  if (!target) return;
  target.textContent = text;
  target.hidden = !text;
  if (text) input.setAttribute('aria-invalid', 'true');
  else input.removeAttribute('aria-invalid');
}

let defaults = { ...DEFAULTS, ...storage.get(KEY_SETTINGS, {}) };
// The scope the dialog edits: null for the defaults, else {id, values, save(changes) -> Promise}.
let scope = null;
let values = defaults;
let saveTimer = 0;
let unsaved = null;

/** The system prompt for a new conversation, or '' for the server's. */
export const systemPrompt = () => (defaults.system.trim() ? defaults.system : '');

/** ``values``'s sampling parameters as a `params` object (capped at the server's limit), or null for none. */
export function paramsOf(settings, limits = {}) {
  const params = {};
  if (Number.isFinite(settings.temperature)) params.temperature = settings.temperature;
  if (Number.isFinite(settings.top_p)) params.top_p = settings.top_p;
  if (Number.isInteger(settings.max_new_tokens)) {
    const cap = limits.max_new_tokens;
    params.max_new_tokens = cap ? Math.min(settings.max_new_tokens, cap) : settings.max_new_tokens;
  }
  if (Number.isInteger(settings.seed)) params.seed = settings.seed;
  return Object.keys(params).length ? params : null;
}

/** The `params` of the defaults (for a new chat, or a conversation without settings of its own). */
export const params = (limits) => paramsOf(defaults, limits);

/** A conversation's settings as the form holds them (its stored params, else the defaults it follows). */
export function valuesOf(conversation) {
  const own = conversation.params && Object.keys(conversation.params).length ? conversation.params : null;
  const base = own ? { ...DEFAULTS, ...own } : { ...DEFAULTS, ...Object.fromEntries(PARAMS.map((k) => [k, defaults[k]])) };
  return { ...base, system: conversation.system || '' };
}

function showOutputs() {
  els.outTemperature.textContent = values.temperature === null ? 'default' : values.temperature.toFixed(2);
  els.outTopP.textContent = values.top_p === null ? 'default' : values.top_p.toFixed(2);
}

/** Fill the form from the scope's values. */
export function show() {
  els.setSystem.value = values.system;
  els.setTemperature.value = values.temperature ?? SLIDER_DEFAULTS.temperature;
  els.setTopP.value = values.top_p ?? SLIDER_DEFAULTS.top_p;
  els.setMaxTokens.value = values.max_new_tokens ?? '';
  els.setSeed.value = values.seed ?? '';
  const cap = Number(els.setMaxTokens.max);
  fieldProblem(els.setMaxTokens, cap && values.max_new_tokens > cap
    ? `Above this server’s limit: answers stop at ${cap.toLocaleString()} tokens.` : '');
  fieldProblem(els.setSeed, '');
  showOutputs();
}

function status(text) {
  els.settingsStatus.textContent = text;
}

/** Send what changed in the conversation scope (a moment after the last change, or at once). */
async function flush() {
  clearTimeout(saveTimer);
  if (!scope || !unsaved) return;
  const target = scope;
  const changes = { system: unsaved.system.trim() ? unsaved.system : null, params: paramsOf(unsaved) || {} };
  unsaved = null;
  status('Saving…');
  try {
    await target.save(changes);
    if (target === scope) status('Saved for this chat.');
  } catch (err) {
    if (target === scope) status(`Not saved: ${err.message}`);
  }
}

function changed() {
  if (!scope) {
    storage.set(KEY_SETTINGS, defaults);
    return;
  }
  unsaved = values;
  clearTimeout(saveTimer);
  saveTimer = setTimeout(flush, SAVE_DELAY_MS);
}

/** A form field changed: keep its value. */
export function read(input) {
  const parse = PARSE[input.name];
  if (!parse) return;
  const value = parse(input);
  fieldProblem(input, value === undefined ? PROBLEMS[input.name]() : '');
  if (value === undefined) return;
  values[input.name] = value;
  showOutputs();
  changed();
}

/** What the dialog holds now, as a preset keeps it: {system, params}. */
export const currentChoice = () => ({ system: values.system.trim() ? values.system : null, params: paramsOf(values) || {} });

/** Set the dialog's scope to a preset's system prompt and parameters (the rest: defaults), and save. */
export function apply({ system, params }) {
  Object.assign(values, DEFAULTS, Object.fromEntries(PARAMS.filter((k) => k in (params || {})).map((k) => [k, params[k]])));
  values.system = system || '';
  show();
  changed();
}

export function reset() {
  Object.assign(values, DEFAULTS);
  show();
  changed();
}

/** Open the dialog on the defaults (``conversation`` null) or on that conversation's own settings:
 * ``conversation`` {id, system, params, model}, ``save(changes)`` stores {system, params} for it. */
export function open(conversation = null, save = null) {
  flush();
  scope = conversation ? { id: conversation.id, save } : null;
  values = conversation ? valuesOf(conversation) : defaults;
  status('');
  els.settingsTitle.textContent = conversation ? 'Chat settings' : 'Settings';
  els.settingsScope.textContent = conversation
    ? 'For this conversation only: every answer in it uses these. Defaults for new chats are under Settings in the sidebar.'
    : 'Defaults for new chats. Each conversation keeps its own: ⋯ → Chat settings.';
  els.systemHelp.textContent = conversation ? 'Used from the next answer on.' : 'Used when a new conversation starts.';
  els.settingsReset.textContent = conversation ? 'Reset to server defaults' : 'Reset to defaults';
  els.settingsModel.textContent = conversation?.model || els.modelName.textContent || '—';
  show();
  els.settings.showModal();
}

/** The dialog closed: what is still waiting to be saved goes now. */
export const closed = () => flush();

/** Show the model's name and limits from `ready` (in the top bar, the welcome text and the dialog). */
export function showServer(model, limits, waiting) {
  const name = { loading: 'Loading the model…', failed: 'Model unavailable' }[waiting] || model;
  els.modelName.textContent = name;
  els.settingsModel.textContent = name || '—';
  if (waiting === 'loading') els.emptyModel.textContent = 'The model is loading. Answers start as soon as it is ready.';
  else if (waiting) els.emptyModel.textContent = 'The model cannot be reached right now. This page notices when it can.';
  else if (model) els.emptyModel.textContent = `You are chatting with ${model}. Answers stream in as they are written.`;
  const parts = [];
  if (limits.max_new_tokens) parts.push(`${limits.max_new_tokens.toLocaleString()} new tokens`);
  if (limits.context_tokens) parts.push(`${limits.context_tokens.toLocaleString()}-token context`);
  if (limits.max_content_chars) parts.push(`${limits.max_content_chars.toLocaleString()} characters per message`);
  els.settingsLimits.textContent = parts.join(' · ') || '—';
  if (limits.max_new_tokens) {
    els.setMaxTokens.max = limits.max_new_tokens;
    els.maxTokensHelp.textContent = `Up to ${limits.max_new_tokens.toLocaleString()}. Empty: the server default.`;
  }
}

/** A short line of a conversation's own settings (system prompt, sampling), '' when it has none. */
export function summary(conversation) {
  const parts = [];
  if (conversation.system) {
    const text = conversation.system.replace(/\s+/g, ' ').trim();
    parts.push(`System: ${text.length > 60 ? `${text.slice(0, 59)}…` : text}`);
  }
  const p = conversation.params || {};
  if (Number.isFinite(p.temperature)) parts.push(`temperature ${p.temperature}`);
  if (Number.isFinite(p.top_p)) parts.push(`top p ${p.top_p}`);
  if (Number.isInteger(p.max_new_tokens)) parts.push(`${p.max_new_tokens} tokens`);
  if (Number.isInteger(p.seed)) parts.push(`seed ${p.seed}`);
  if (p.enable_thinking === false) parts.push('thinking off');
  return parts.join(' · ');
}

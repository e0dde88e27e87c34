// The settings dialog: generation settings kept in the browser, and what the server said about its model.
import { els } from './dom.js';
import { storage } from './util.js';

const KEY_SETTINGS = 'chat.settings';
// null means "not set": the server's default applies and nothing is sent.
const DEFAULTS = { system: '', temperature: null, top_p: null, max_new_tokens: null, seed: null };
const SLIDER_DEFAULTS = { temperature: 0.7, top_p: 0.9 };

const intOrNull = (raw, low) => {
  const value = parseInt(raw, 10);
  return Number.isInteger(value) && value >= low ? value : null;
};

// How each field of the form (by its name) becomes a setting.
const PARSE = {
  system: (raw) => raw,
  temperature: (raw) => Number(raw),
  top_p: (raw) => Math.max(0.05, Number(raw)),
  max_new_tokens: (raw) => intOrNull(raw, 1),
  seed: (raw) => intOrNull(raw, 0),
};

let settings = { ...DEFAULTS, ...storage.get(KEY_SETTINGS, {}) };

/** The system prompt for a new conversation, or '' for the server's. */
export const systemPrompt = () => (settings.system.trim() ? settings.system : '');

/** The `params` of a chat or regenerate frame (capped at the server's limit), or null for none. */
export function params(limits) {
  const params = {};
  if (settings.temperature !== null) params.temperature = settings.temperature;
  if (settings.top_p !== null) params.top_p = settings.top_p;
  if (settings.max_new_tokens !== null) {
    const cap = limits.max_new_tokens;
    params.max_new_tokens = cap ? Math.min(settings.max_new_tokens, cap) : settings.max_new_tokens;
  }
  if (Number.isInteger(settings.seed)) params.seed = settings.seed;
  return Object.keys(params).length ? params : null;
}

function showOutputs() {
  els.outTemperature.textContent = settings.temperature === null ? 'default' : settings.temperature.toFixed(2);
  els.outTopP.textContent = settings.top_p === null ? 'default' : settings.top_p.toFixed(2);
}

/** Fill the form from the saved settings. */
export function show() {
  els.setSystem.value = settings.system;
  els.setTemperature.value = settings.temperature ?? SLIDER_DEFAULTS.temperature;
  els.setTopP.value = settings.top_p ?? SLIDER_DEFAULTS.top_p;
  els.setMaxTokens.value = settings.max_new_tokens ?? '';
  els.setSeed.value = settings.seed ?? '';
  showOutputs();
}

/** A form field changed: keep its value. */
export function read(input) {
  const parse = PARSE[input.name];
  if (!parse) return;
  settings[input.name] = parse(input.value);
  storage.set(KEY_SETTINGS, settings);
  showOutputs();
}

export function reset() {
  settings = { ...DEFAULTS };
  storage.set(KEY_SETTINGS, settings);
  show();
}

export function open() {
  show();
  els.settings.showModal();
}

/** Show the model's name and limits from `ready` (in the top bar, the welcome text and the dialog). */
export function showServer(model, limits) {
  els.modelName.textContent = model;
  els.settingsModel.textContent = model || '—';
  if (model) els.emptyModel.textContent = `You are chatting with ${model}. Answers stream in as they are written.`;
  const parts = [];
  if (limits.max_new_tokens) parts.push(`${limits.max_new_tokens.toLocaleString()} new tokens`);
  if (limits.context_tokens) parts.push(`${limits.context_tokens.toLocaleString()}-token context`);
  if (limits.max_content_chars) parts.push(`${limits.max_content_chars.toLocaleString()} characters per message`);
  els.settingsLimits.textContent = parts.join(' · ') || '—';
  if (limits.max_new_tokens) {
    els.setMaxTokens.max = limits.max_new_tokens;
    els.maxTokensHelp.textContent = `Up to ${limits.max_new_tokens.toLocaleString()}. Empty uses the server default.`;
  }
}

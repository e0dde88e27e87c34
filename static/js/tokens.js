// Token probabilities on demand: with the setting on, answers are asked for their tokens' log
// probabilities (params.logprobs); such an answer gets a Probabilities action that shows its tokens,
// each with its probability and the alternatives the model weighed, on hover or keyboard focus.
import { storage } from './util.js';

const KEY = 'chat.tokenProbs';
const TOP = 5;

/** Whether answers ask for token probabilities (a browser setting, like the defaults). */
export const wanted = () => storage.get(KEY, false) === true;

/** ``params`` with the log probability fields added when the setting is on. */
export function withLogprobs(params) {
  return wanted() ? { ...(params || {}), logprobs: true, top_logprobs: TOP } : params;
}

/** Wire the settings dialog's checkbox. */
export function init() {
  const box = document.getElementById('set-token-probs');
  if (!box) return;
  box.checked = wanted();
  box.addEventListener('change', () => storage.set(KEY, box.checked));
}

/** Keep a delta frame's entries on the answer they belong to. */
export function add(view, entries) {
  if (!entries?.length) return;
  (view.tokens ||= []).push(...entries);
}

const percent = (logprob) => {
  const p = Math.exp(logprob) * 100;
  return p >= 99.95 ? '100%' : p >= 0.1 ? `${p.toFixed(1)}%` : '<0.1%';
};
const shown = (token) => JSON.stringify(token).slice(1, -1) || '∅';

/** The Probabilities action for an answer that has its tokens' entries. */
export function action(view) {
  const button = document.createElement('button');
  button.type = 'button';
  button.className = 'icon-btn';
  button.dataset.testid = 'show-probabilities';
  button.setAttribute('aria-expanded', 'false');
  button.innerHTML = '<span>Probabilities</span>';
  button.addEventListener('click', () => toggle(view, button));
  return button;
}

function toggle(view, button) {
  const open = view.el.querySelector('.token-view');
  button.setAttribute('aria-expanded', String(!open));
  if (open) {
    open.remove();
    theTip().hidden = true;
    return;
  }
  const panel = document.createElement('div');
  panel.className = 'token-view';
  panel.dataset.testid = 'token-view';
  panel.setAttribute('aria-label', 'The answer token by token');
  const tip = theTip();
  for (const entry of view.tokens || []) {
    const el = document.createElement('span');
    el.className = 'token';
    el.dataset.testid = 'token';
    el.tabIndex = 0;
    el.textContent = entry.token;
    el.setAttribute('aria-describedby', tip.id);
    // hue from red (unlikely) to green (certain)
    el.style.setProperty('--p', String(Math.exp(entry.logprob)));
    const show = () => showTip(tip, el, entry);
    el.addEventListener('mouseenter', show);
    el.addEventListener('focus', show);
    el.addEventListener('mouseleave', () => { tip.hidden = true; });
    el.addEventListener('blur', () => { tip.hidden = true; });
    panel.append(el);
  }
  view.body.after(panel);
}

/** The one tooltip, on the page's body: no scrolling or transformed box of the thread clips it. */
function theTip() {
  let tip = document.getElementById('token-tip');
  if (!tip) {
    tip = document.createElement('div');
    tip.id = 'token-tip';
    tip.className = 'token-tip';
    tip.dataset.testid = 'token-tip';
    tip.setAttribute('role', 'tooltip');
    tip.hidden = true;
    document.body.append(tip);
  }
  return tip;
}

function showTip(tip, el, entry) {
  tip.replaceChildren();
  const head = document.createElement('div');
  head.className = 'token-tip-head';
  head.textContent = `“${shown(entry.token)}” ${percent(entry.logprob)}`;
  tip.append(head);
  const list = document.createElement('ol');
  for (const alt of entry.top_logprobs || []) {
    const item = document.createElement('li');
    item.dataset.testid = 'token-alternative';
    item.textContent = `“${shown(alt.token)}” ${percent(alt.logprob)}`;
    if (alt.token === entry.token) item.className = 'chosen';
    list.append(item);
  }
  if (list.childElementCount) tip.append(list);
  // fixed to the viewport: the thread's scrolling boxes never clip it
  tip.hidden = false;
  const at = el.getBoundingClientRect();
  const below = at.bottom + 4 + tip.offsetHeight <= window.innerHeight;
  tip.style.left = `${Math.max(4, Math.min(at.left, window.innerWidth - tip.offsetWidth - 4))}px`;
  tip.style.top = `${below ? at.bottom + 4 : Math.max(4, at.top - tip.offsetHeight - 4)}px`;
}

// Search in the sidebar: results as you type, the matched words marked from the server's
// offsets with DOM text nodes and <mark> elements (never by writing the text as HTML).
import { els } from './dom.js';
import * as api from './api.js';
import { when } from './message.js';

const DEBOUNCE_MS = 150;
let timer = 0;
let latest = 0;

/** The search box changed: search a moment later, or go back to the conversation list. */
export function onInput() {
  clearTimeout(timer);
  const q = els.search.value.trim();
  if (!q) {
    latest += 1;
    show(null);
    return;
  }
  timer = setTimeout(() => run(q), DEBOUNCE_MS);
}

/** Empty the box and show the conversation list again. */
export function clear() {
  els.search.value = '';
  onInput();
}

async function run(q) {
  const token = ++latest;
  let results;
  try {
    ({ results } = await api.search(q));
  } catch (err) {
    if (token === latest) show([], `Search failed: ${err.message}`);
    return;
  }
  if (token === latest) show(results);
}

/** Where each character (code point, as the server counts) of ``text`` starts in its UTF-16 string. */
function utf16Offsets(text) {
  const offsets = [0];
  let at = 0;
  for (const ch of text) {
    at += ch.length;
    offsets.push(at);
  }
  return offsets;
}

/** ``snippet`` with the [start, end) character ranges in ``spans`` wrapped in <mark>. */
export function highlighted(snippet, spans) {
  const fragment = document.createDocumentFragment();
  const offsets = utf16Offsets(snippet);
  let at = 0;
  for (const [from, to] of spans) {
    if (from < 0 || to >= offsets.length) continue;
    const start = offsets[from];
    const end = offsets[to];
    if (start < at || end <= start) continue;
    fragment.append(document.createTextNode(snippet.slice(at, start)));
    const mark = document.createElement('mark');
    mark.textContent = snippet.slice(start, end);
    fragment.append(mark);
    at = end;
  }
  fragment.append(document.createTextNode(snippet.slice(at)));
  return fragment;
}

function hit(result) {
  const li = document.createElement('li');
  const button = document.createElement('button');
  button.type = 'button';
  button.className = 'search-hit';
  button.dataset.testid = 'search-hit';
  button.dataset.conversation = result.conversation_id;
  button.dataset.message = result.message_id;
  const title = document.createElement('span');
  title.className = 'hit-title';
  title.textContent = result.title;
  const snippet = document.createElement('span');
  snippet.className = 'hit-snippet';
  snippet.append(highlighted(result.snippet, result.highlights));
  if (result.created_at) {
    const date = document.createElement('time');
    date.className = 'hit-date';
    date.dataset.testid = 'hit-date';
    date.dateTime = new Date(result.created_at * 1000).toISOString();
    date.textContent = when(result.created_at);
    title.append(' ', date);
  }
  button.append(title, snippet);
  li.append(button);
  return li;
}

/** Results (null: none, show the conversation list), or a note instead of them. */
function show(results, note = '') {
  const searching = results !== null;
  els.searchResults.hidden = !searching;
  els.list.hidden = searching;
  els.listEmpty.hidden = searching || els.list.children.length > 0;
  if (!searching) return;
  const items = results.map(hit);
  if (!items.length) {
    const empty = document.createElement('li');
    empty.className = 'conversations-empty';
    empty.textContent = note || 'No matches.';
    items.push(empty);
  }
  els.searchResults.replaceChildren(...items);
}

const hits = () => [...els.searchResults.querySelectorAll('.search-hit')];

/** Keys in the search box: ↓ goes to the results, Enter opens the first. */
export function onKeydown(e) {
  if (e.isComposing || els.searchResults.hidden) return;
  const first = hits()[0];
  if (!first) return;
  if (e.key === 'ArrowDown') {
    e.preventDefault();
    first.focus();
  } else if (e.key === 'Enter') {
    e.preventDefault();
    first.click();
  }
}

/** Keys on the results: ↑/↓/Home/End between them (↑ from the first back to the box), Esc to the box. */
export function onResultsKeydown(e) {
  const list = hits();
  const at = list.indexOf(document.activeElement);
  if (at < 0) return;
  let target = null;
  if (e.key === 'ArrowDown') target = list[Math.min(at + 1, list.length - 1)];
  else if (e.key === 'ArrowUp') target = at === 0 ? els.search : list[at - 1];
  else if (e.key === 'Home') target = list[0];
  else if (e.key === 'End') target = list[list.length - 1];
  else if (e.key === 'Escape') target = els.search;
  if (!target) return;
  e.preventDefault();
  e.stopPropagation();
  target.focus();
}

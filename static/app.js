// The chat page: conversations sidebar, streaming answers over the chat.v1 WebSocket.
import { MarkdownView, codeTextFor } from './markdown.js';

const $ = (id) => document.getElementById(id);

const els = {
  app: $('app'),
  sidebar: $('sidebar'),
  sidebarToggle: $('sidebar-toggle'),
  sidebarClose: $('sidebar-close'),
  scrim: $('scrim'),
  newChat: $('new-chat'),
  list: $('conversation-list'),
  listEmpty: $('conversations-empty'),
  title: $('chat-title'),
  modelName: $('model-name'),
  conn: $('conn'),
  connText: $('conn-text'),
  exportMenu: $('export'),
  exportMd: $('export-md'),
  exportJson: $('export-json'),
  messages: $('messages'),
  thread: $('thread'),
  empty: $('empty'),
  emptyModel: $('empty-model'),
  jump: $('jump'),
  composer: $('composer'),
  error: $('composer-error'),
  prompt: $('prompt'),
  send: $('send'),
  stop: $('stop'),
  charCount: $('char-count'),
  announcer: $('announcer'),
  settings: $('settings'),
  openSettings: $('open-settings'),
  settingsModel: $('settings-model'),
  settingsLimits: $('settings-limits'),
  setSystem: $('set-system'),
  setTemperature: $('set-temperature'),
  setTopP: $('set-top-p'),
  setMaxTokens: $('set-max-tokens'),
  setSeed: $('set-seed'),
  outTemperature: $('out-temperature'),
  outTopP: $('out-top-p'),
  maxTokensHelp: $('max-tokens-help'),
  settingsReset: $('settings-reset'),
  tplConversation: $('tpl-conversation'),
};

// ---------------------------------------------------------------- storage

const KEY_CONVERSATION = 'chat.conversation';
const KEY_SETTINGS = 'chat.settings';
const KEY_TITLES = 'chat.titles';
const KEY_INFLIGHT = 'chat.inflight';

const storage = {
  get(key, fallback) {
    try {
      const raw = localStorage.getItem(key);
      return raw === null ? fallback : JSON.parse(raw);
    } catch { return fallback; }
  },
  set(key, value) {
    try { localStorage.setItem(key, JSON.stringify(value)); } catch { /* private mode, quota */ }
  },
  remove(key) {
    try { localStorage.removeItem(key); } catch { /* ignore */ }
  },
};

// null means "not set": the server's default applies and nothing is sent.
const DEFAULT_SETTINGS = { system: '', temperature: null, top_p: null, max_new_tokens: null, seed: null };
const SLIDER_DEFAULTS = { temperature: 0.7, top_p: 0.9 };

// ---------------------------------------------------------------- state

const state = {
  ws: null,
  ready: false,
  everReady: false,
  attempt: 0,
  reconnectTimer: 0,
  countdownTimer: 0,
  model: '',
  limits: {},
  conversationId: null,
  conversations: [],
  titles: storage.get(KEY_TITLES, {}),
  requests: new Map(),
  viewToken: 0,
  settings: { ...DEFAULT_SETTINGS, ...storage.get(KEY_SETTINGS, {}) },
  follow: true,
  lastScrollTop: 0,
  expectedScrollTop: -1,
};

// ---------------------------------------------------------------- helpers

function newId() {
  // crypto.randomUUID needs a secure context; getRandomValues works over plain http too.
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return 'c' + Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}

function svgIcon(paths) {
  return `<svg viewBox="0 0 24 24" aria-hidden="true">${paths}</svg>`;
}
const ICON_COPY = svgIcon('<rect x="9" y="9" width="11" height="11" rx="2"/><path d="M5 15V5a1 1 0 0 1 1-1h9"/>');
const ICON_CHECK = svgIcon('<path d="M5 12l5 5L20 7"/>');
const ICON_REGEN = svgIcon('<path d="M20 11a8 8 0 1 0-2.3 5.7M20 5v6h-6"/>');

function announce(text) {
  els.announcer.textContent = '';
  // A fresh text node after a tick makes screen readers read repeated messages too.
  setTimeout(() => { els.announcer.textContent = text; }, 30);
}

/** Length in code points, as the server counts ``max_content_chars``. */
function charLength(text) {
  let n = 0;
  for (const _ of text) n += 1;
  return n;
}

function fmtDuration(ms) {
  if (ms < 1000) return `${Math.round(ms)} ms`;
  return ms < 10000 ? `${(ms / 1000).toFixed(2)} s` : `${(ms / 1000).toFixed(1)} s`;
}

async function api(path, options = {}) {
  const init = { credentials: 'same-origin', headers: { Accept: 'application/json' }, ...options };
  if (options.json !== undefined) {
    init.body = JSON.stringify(options.json);
    init.headers['Content-Type'] = 'application/json';
    delete init.json;
  }
  const res = await fetch(path, init);
  if (!res.ok) {
    let detail = null;
    try { detail = (await res.json()).error; } catch { /* not JSON */ }
    const err = new Error(detail?.message || `${res.status} ${res.statusText}`);
    err.status = res.status;
    err.code = detail?.code;
    throw err;
  }
  if (res.status === 204) return null;
  const type = res.headers.get('Content-Type') || '';
  return type.includes('json') ? res.json() : null;
}

const convUrl = (id) => `/api/conversations/${encodeURIComponent(id)}`;

// ---------------------------------------------------------------- errors near the input

const FRIENDLY = {
  too_large: () => `That message is too long${state.limits.max_content_chars ? ` (the limit is ${state.limits.max_content_chars.toLocaleString()} characters)` : ''}.`,
  busy: () => 'An answer is still being written. Wait for it to finish or press Stop.',
  rate_limited: () => 'You are sending messages too quickly. Please wait a moment and try again.',
  overloaded: () => 'The server is at capacity right now. Please try again in a moment.',
  not_found: () => 'This conversation no longer exists.',
  internal: () => 'The server ran into a problem. Please try again.',
};

function errorText(code, message) {
  const friendly = FRIENDLY[code];
  return friendly ? friendly() : (message || code || 'Something went wrong.');
}

function showError(text) {
  els.error.textContent = text;
  els.error.hidden = false;
}

function clearError() {
  els.error.hidden = true;
  els.error.textContent = '';
}

// ---------------------------------------------------------------- scrolling

function distanceFromBottom() {
  const m = els.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight;
}

function scrollToBottom(smooth = false) {
  const m = els.messages;
  const top = m.scrollHeight - m.clientHeight;
  if (top <= 0) return;
  state.expectedScrollTop = top;
  if (smooth) m.scrollTo({ top, behavior: 'smooth' });
  else m.scrollTop = top;
}

function followStream() {
  if (state.follow) scrollToBottom();
  updateJump();
}

function updateJump() {
  els.jump.hidden = state.follow || distanceFromBottom() < 40;
}

els.messages.addEventListener('scroll', () => {
  const top = els.messages.scrollTop;
  const ours = Math.abs(top - state.expectedScrollTop) < 2;
  if (distanceFromBottom() < 24) state.follow = true;
  else if (!ours && top < state.lastScrollTop) state.follow = false;
  state.lastScrollTop = top;
  updateJump();
}, { passive: true });

// Wheel/touch intent wins immediately, even before the next scroll event.
els.messages.addEventListener('wheel', (e) => {
  if (e.deltaY < 0 && els.messages.scrollTop > 0) state.follow = false;
}, { passive: true });
els.messages.addEventListener('keydown', (e) => {
  if (['PageUp', 'ArrowUp', 'Home'].includes(e.key)) state.follow = false;
});

// Keep the latest line in view when the viewport or composer changes size.
new ResizeObserver(() => { if (state.follow) scrollToBottom(); }).observe(els.messages);

els.jump.addEventListener('click', () => {
  state.follow = true;
  scrollToBottom(true);
  els.jump.hidden = true;
});

// ---------------------------------------------------------------- rendering, batched per frame

const dirty = new Set();
let frameRequested = false;

function scheduleRender(req) {
  dirty.add(req);
  if (!frameRequested) {
    frameRequested = true;
    requestAnimationFrame(renderFrame);
  }
}

function renderFrame() {
  frameRequested = false;
  for (const req of dirty) req.view.setText(req.text, req.done);
  dirty.clear();
  followStream();
}

// ---------------------------------------------------------------- message views

function hideEmpty() {
  els.empty.hidden = true;
}

function appendUser(content) {
  hideEmpty();
  const article = document.createElement('article');
  article.className = 'msg msg-user';
  article.dataset.testid = 'message-user';
  article.setAttribute('aria-label', 'You');
  const body = document.createElement('div');
  body.className = 'msg-body';
  body.textContent = content;
  article.append(body);
  els.thread.append(article);
  return article;
}

class AssistantMessage {
  constructor() {
    const article = document.createElement('article');
    article.className = 'msg msg-assistant';
    article.dataset.testid = 'message-assistant';
    article.setAttribute('aria-label', 'Assistant');
    article.innerHTML = '<div class="msg-avatar" aria-hidden="true"></div>'
      + '<div class="msg-main"><div class="msg-body markdown"></div>'
      + '<div class="msg-status" hidden></div><div class="msg-meta"></div></div>';
    this.el = article;
    this.el.view = this;
    this.body = article.querySelector('.msg-body');
    this.status = article.querySelector('.msg-status');
    this.meta = article.querySelector('.msg-meta');
    this.markdown = new MarkdownView(this.body);
    this.text = '';
  }

  setThinking(label = '') {
    this.el.classList.add('streaming');
    this.el.dataset.state = 'waiting';
    this.el.setAttribute('aria-busy', 'true');
    this.status.hidden = false;
    this.status.innerHTML = '<span class="thinking" aria-hidden="true"><span></span><span></span><span></span></span>';
    const text = document.createElement('span');
    text.className = 'status-text';
    text.dataset.testid = 'thinking';
    text.textContent = label || 'Thinking…';
    this.status.append(text);
    this.meta.replaceChildren();
  }

  setText(text, final) {
    this.text = text;
    if (text) {
      this.status.hidden = true;
      if (!final) this.el.dataset.state = 'streaming';
    }
    this.markdown.update(text, final);
  }

  finish({ reason, timings, usage } = {}) {
    this.el.classList.remove('streaming');
    this.el.dataset.state = 'done';
    this.el.dataset.reason = reason || '';
    this.el.removeAttribute('aria-busy');
    this.status.hidden = true;
    this.meta.replaceChildren();
    const label = REASONS[reason];
    if (label) {
      const tag = document.createElement('span');
      tag.className = 'msg-reason' + (['error', 'timeout', 'shutdown'].includes(reason) ? ' bad' : '');
      tag.dataset.testid = 'done-reason';
      tag.textContent = label;
      this.meta.append(tag);
    }
    const parts = [];
    if (timings && Number.isFinite(timings.ttft_ms)) parts.push(`${fmtDuration(timings.ttft_ms)} to first token`);
    if (timings && Number.isFinite(timings.tokens_per_s) && timings.tokens_per_s > 0) parts.push(`${timings.tokens_per_s.toFixed(1)} tokens/s`);
    if (usage && Number.isFinite(usage.completion_tokens)) parts.push(`${usage.completion_tokens} tokens`);
    if (parts.length) {
      const stats = document.createElement('span');
      stats.className = 'msg-stats';
      stats.dataset.testid = 'stats';
      stats.textContent = parts.join(' · ');
      this.meta.append(stats);
    }
    this.addActions();
  }

  addActions() {
    const actions = document.createElement('span');
    actions.className = 'msg-actions';
    actions.innerHTML = `<button type="button" class="icon-btn" data-action="copy-message">${ICON_COPY}<span>Copy</span></button>`
      + `<button type="button" class="icon-btn" data-action="regenerate" data-testid="regenerate" hidden>${ICON_REGEN}<span>Regenerate</span></button>`;
    this.meta.prepend(actions);
  }

  fail(text) {
    this.el.classList.remove('streaming');
    this.el.classList.add('is-error');
    this.el.dataset.state = 'error';
    this.el.removeAttribute('aria-busy');
    this.status.hidden = true;
    if (!this.text) {
      this.body.textContent = text;
    } else {
      const tag = document.createElement('span');
      tag.className = 'msg-reason bad';
      tag.textContent = text;
      this.meta.append(tag);
    }
  }
}

const REASONS = {
  length: 'Length limit reached',
  cancelled: 'Stopped',
  timeout: 'Timed out',
  shutdown: 'Server restarting',
  error: 'Generation failed',
};

function updateRegenerate() {
  const busy = activeInView().length > 0;
  const last = [...els.thread.querySelectorAll('.msg')].pop();
  for (const button of els.thread.querySelectorAll('[data-action="regenerate"]')) {
    const article = button.closest('.msg');
    button.hidden = busy || article !== last || !state.conversationId;
  }
}

// Copy buttons (code blocks and whole answers) through one delegated listener.
els.thread.addEventListener('click', async (e) => {
  const button = e.target.closest('button');
  if (!button) return;
  let text = null;
  if (button.dataset.copy === 'code') text = codeTextFor(button);
  else if (button.dataset.action === 'copy-message') text = button.closest('.msg')?.view?.text ?? '';
  else if (button.dataset.action === 'regenerate') { regenerate(); return; }
  if (text === null) return;
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    fallbackCopy(text);
  }
  const label = button.querySelector('span');
  const icon = button.querySelector('svg');
  const oldLabel = label?.textContent;
  const oldIcon = icon?.outerHTML;
  button.classList.add('copied');
  if (label) label.textContent = 'Copied';
  if (icon) icon.outerHTML = ICON_CHECK;
  announce('Copied to clipboard');
  setTimeout(() => {
    button.classList.remove('copied');
    if (label) label.textContent = oldLabel;
    const now = button.querySelector('svg');
    if (now && oldIcon) now.outerHTML = oldIcon;
  }, 1500);
});

function fallbackCopy(text) {
  // navigator.clipboard needs a secure context; plain-http deployments use this.
  const area = document.createElement('textarea');
  area.value = text;
  area.setAttribute('readonly', '');
  area.className = 'sr-only';
  document.body.append(area);
  area.select();
  try { document.execCommand('copy'); } catch { /* nothing more to try */ }
  area.remove();
}

// ---------------------------------------------------------------- requests

function activeInView() {
  return [...state.requests.values()].filter((r) => !r.done && r.conversationId === state.conversationId);
}

function updateComposer() {
  const streaming = activeInView().length > 0;
  const hadFocus = document.activeElement === els.send || document.activeElement === els.stop;
  els.send.hidden = streaming;
  els.stop.hidden = !streaming;
  const content = els.prompt.value;
  els.send.disabled = !state.ready || !content.trim();
  els.send.title = state.ready ? 'Send (Enter)' : 'Waiting for the connection…';
  if (hadFocus) (streaming ? els.stop : els.send).focus();
  const max = state.limits.max_content_chars;
  const length = max && content.length > max * 0.5 ? charLength(content) : 0;
  if (max && length > max * 0.8) {
    els.charCount.textContent = `${length.toLocaleString()} / ${max.toLocaleString()}`;
    els.charCount.classList.toggle('over', length > max);
  } else {
    els.charCount.textContent = '';
  }
  updateRegenerate();
}

function currentParams() {
  const s = state.settings;
  const params = {};
  if (s.temperature !== null) params.temperature = s.temperature;
  if (s.top_p !== null) params.top_p = s.top_p;
  if (s.max_new_tokens !== null) {
    const cap = state.limits.max_new_tokens;
    params.max_new_tokens = cap ? Math.min(s.max_new_tokens, cap) : s.max_new_tokens;
  }
  if (Number.isInteger(s.seed)) params.seed = s.seed;
  return Object.keys(params).length ? params : null;
}

function wsSend(message) {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return false;
  state.ws.send(JSON.stringify(message));
  return true;
}

function sendChat() {
  const content = els.prompt.value.replace(/^\s*\n/, '').trimEnd();
  if (!content.trim() || activeInView().length) return;
  if (!state.ready) {
    showError('Not connected to the server yet. Your message is kept; send it once the connection is back.');
    return;
  }
  const max = state.limits.max_content_chars;
  if (max && charLength(content) > max) {
    showError(FRIENDLY.too_large());
    return;
  }
  clearError();
  const id = newId();
  const message = { type: 'chat', id, content };
  if (state.conversationId) message.conversation_id = state.conversationId;
  else if (state.settings.system.trim()) message.system = state.settings.system;
  const params = currentParams();
  if (params) message.params = params;

  const userEl = appendUser(content);
  const view = new AssistantMessage();
  view.setThinking();
  els.thread.append(view.el);
  const req = {
    id, kind: 'chat', content, conversationId: state.conversationId,
    userEl, view, oldView: null, text: '', nextIndex: 0, pending: new Map(),
    started: false, done: false, sent: false, cancelRequested: false,
  };
  state.requests.set(id, req);
  req.sent = wsSend(message);
  els.prompt.value = '';
  autosize();
  state.follow = true;
  scrollToBottom();
  updateComposer();
}

function regenerate() {
  if (!state.ready || !state.conversationId || activeInView().length) return;
  const messages = [...els.thread.querySelectorAll('.msg')];
  const last = messages.pop();
  if (!last || !last.classList.contains('msg-assistant')) return;
  clearError();
  const id = newId();
  const message = { type: 'regenerate', id, conversation_id: state.conversationId };
  const params = currentParams();
  if (params) message.params = params;
  const view = new AssistantMessage();
  view.setThinking();
  last.replaceWith(view.el);
  const req = {
    id, kind: 'regenerate', content: '', conversationId: state.conversationId,
    userEl: null, view, oldView: last, text: '', nextIndex: 0, pending: new Map(),
    started: false, done: false, sent: false, cancelRequested: false,
  };
  state.requests.set(id, req);
  req.sent = wsSend(message);
  state.follow = true;
  scrollToBottom();
  updateComposer();
}

function stopStreaming() {
  const active = activeInView();
  if (!active.length) return false;
  for (const req of active) {
    req.cancelRequested = true;
    wsSend({ type: 'cancel', id: req.id });
  }
  return true;
}

/** Undo the optimistic UI of a request the server refused (no start, no done). */
function rollback(req) {
  state.requests.delete(req.id);
  if (req.kind === 'regenerate' && req.oldView) {
    req.view.el.replaceWith(req.oldView);
  } else {
    req.view.el.remove();
    req.userEl?.remove();
    if (req.content && !els.prompt.value.trim()) {
      els.prompt.value = req.content;
      autosize();
    }
  }
  if (!els.thread.querySelector('.msg')) els.empty.hidden = false;
}

// ---------------------------------------------------------------- protocol handling

function onReady(msg) {
  state.ready = true;
  state.attempt = 0;
  state.model = msg.model || '';
  state.limits = msg.limits || {};
  setConn('open', 'Connected');
  state.everReady = true;
  showModel();
  for (const req of state.requests.values()) {
    if (req.done) continue;
    if (req.sent) {
      req.resuming = true;
      wsSend({ type: 'resume', id: req.id, from: req.nextIndex });
      if (req.cancelRequested) wsSend({ type: 'cancel', id: req.id });
    } else if (!req.started) {
      rollback(req);
    }
  }
  updateComposer();
  refreshConversations();
}

function onQueued(msg) {
  const req = state.requests.get(msg.id);
  if (!req || req.started) return;
  req.view.setThinking(msg.position > 1 ? `Waiting in line · position ${msg.position}` : 'Waiting in line · next up');
}

function onStart(msg) {
  const req = state.requests.get(msg.id);
  if (!req) return;
  const wasNew = !req.conversationId;
  req.started = true;
  req.resuming = false;
  req.messageId = msg.message_id;
  if (req.text === '') req.view.setThinking();
  if (wasNew && msg.conversation_id) {
    const viewingIt = state.conversationId === null;
    req.conversationId = msg.conversation_id;
    if (!state.titles[msg.conversation_id] && req.content) {
      state.titles[msg.conversation_id] = req.content.slice(0, 80);
      storage.set(KEY_TITLES, state.titles);
    }
    if (!state.conversations.some((c) => c.id === msg.conversation_id)) {
      state.conversations.unshift({ id: msg.conversation_id, title: '' });
    }
    if (viewingIt) setCurrent(msg.conversation_id);
    renderSidebar();
  }
  if (req.conversationId) storage.set(KEY_INFLIGHT, { id: req.id, conversationId: req.conversationId });
  announce('The assistant is answering.');
  refreshConversationsSoon();
}

function onDelta(msg) {
  const req = state.requests.get(msg.id);
  if (!req || req.done || typeof msg.text !== 'string') return;
  if (msg.index < req.nextIndex) return;
  if (msg.index > req.nextIndex) {
    req.pending.set(msg.index, msg.text);
    return;
  }
  req.text += msg.text;
  req.nextIndex += 1;
  while (req.pending.has(req.nextIndex)) {
    req.text += req.pending.get(req.nextIndex);
    req.pending.delete(req.nextIndex);
    req.nextIndex += 1;
  }
  scheduleRender(req);
}

function onDone(msg) {
  const req = state.requests.get(msg.id);
  if (!req) return;
  req.done = true;
  state.requests.delete(req.id);
  forgetInflight(req.id);
  req.view.setText(req.text, true);
  dirty.delete(req);
  req.view.finish(msg);
  if (!req.text && msg.reason === 'stop') req.view.body.textContent = '(empty answer)';
  followStream();
  updateComposer();
  if (req.conversationId === state.conversationId) {
    const reason = REASONS[msg.reason] ? ` (${REASONS[msg.reason]})` : '';
    announce(`Answer${reason}: ${req.text.slice(0, 2000)}`);
  }
  refreshConversationsSoon();
}

function onError(msg) {
  const req = msg.id ? state.requests.get(msg.id) : null;
  if (!req) {
    showError(errorText(msg.code, msg.message));
    return;
  }
  if (req.resuming && msg.code === 'unknown_id') {
    // The server no longer has this answer: take what it stored.
    state.requests.delete(req.id);
    forgetInflight(req.id);
    req.done = true;
    if (!req.started) {
      // Never accepted: give the text back so nothing typed is lost.
      rollback(req);
      showError('The connection dropped before your message was accepted. Please send it again.');
    }
    if (req.conversationId && req.conversationId === state.conversationId) {
      openConversation(state.conversationId, { keepError: true });
    }
    updateComposer();
    return;
  }
  if (!req.started) {
    rollback(req);
    showError(errorText(msg.code, msg.message));
    if (msg.code === 'not_found' && req.conversationId === state.conversationId) {
      forgetConversation(req.conversationId);
    }
  } else {
    req.done = true;
    state.requests.delete(req.id);
    forgetInflight(req.id);
    req.view.fail(errorText(msg.code, msg.message));
  }
  updateComposer();
}

function forgetInflight(id) {
  if (storage.get(KEY_INFLIGHT, null)?.id === id) storage.remove(KEY_INFLIGHT);
}

/** After a reload during an answer: pick the stream up again (the server keeps it for a grace period). */
function adoptInflight(conversationId) {
  const inflight = storage.get(KEY_INFLIGHT, null);
  if (!inflight || inflight.conversationId !== conversationId || typeof inflight.id !== 'string') return;
  const view = new AssistantMessage();
  view.setThinking();
  state.requests.set(inflight.id, {
    id: inflight.id, kind: 'chat', content: '', conversationId,
    userEl: null, view, oldView: null, text: '', nextIndex: 0, pending: new Map(),
    started: true, done: false, sent: true, cancelRequested: false,
  });
}

const HANDLERS = {
  ready: onReady, queued: onQueued, start: onStart, delta: onDelta, done: onDone, error: onError,
  pong: () => {},
};

// ---------------------------------------------------------------- connection

function wsUrl() {
  const scheme = location.protocol === 'https:' ? 'wss:' : 'ws:';
  return `${scheme}//${location.host}/ws`;
}

function setConn(kind, text) {
  // Screen readers hear transitions only, not every tick of the retry countdown.
  if (state.everReady && kind !== els.conn.dataset.state) {
    if (kind === 'open') announce('Reconnected.');
    else if (kind === 'closed' && els.conn.dataset.state === 'open') announce('Connection lost. Reconnecting…');
  }
  els.conn.dataset.state = kind;
  els.connText.textContent = text;
}

function connect() {
  clearTimeout(state.reconnectTimer);
  clearInterval(state.countdownTimer);
  if (state.ws) return;
  setConn('connecting', state.everReady ? 'Reconnecting…' : 'Connecting…');
  let ws;
  try {
    ws = new WebSocket(wsUrl());
  } catch {
    scheduleReconnect();
    return;
  }
  state.ws = ws;
  ws.addEventListener('message', (event) => {
    if (ws !== state.ws || typeof event.data !== 'string') return;
    let msg;
    try { msg = JSON.parse(event.data); } catch { return; }
    HANDLERS[msg?.type]?.(msg);
  });
  ws.addEventListener('close', () => {
    if (ws !== state.ws) return;
    state.ws = null;
    state.ready = false;
    updateComposer();
    scheduleReconnect();
  });
}

function scheduleReconnect() {
  // Exponential backoff with jitter, so a restarted server is not stampeded.
  const cap = Math.min(30000, 500 * 2 ** Math.min(state.attempt, 10));
  const delay = Math.round(cap / 2 + Math.random() * cap / 2);
  state.attempt += 1;
  const at = Date.now() + delay;
  const tick = () => {
    const left = Math.max(0, Math.ceil((at - Date.now()) / 1000));
    setConn('closed', navigator.onLine === false ? 'Offline' : `Disconnected · retrying in ${left} s`);
  };
  tick();
  clearInterval(state.countdownTimer);
  state.countdownTimer = setInterval(tick, 1000);
  clearTimeout(state.reconnectTimer);
  state.reconnectTimer = setTimeout(connect, delay);
}

function reconnectNow() {
  if (!state.ws) connect();
}

window.addEventListener('online', reconnectNow);
document.addEventListener('visibilitychange', () => {
  if (document.visibilityState === 'visible') reconnectNow();
});

function showModel() {
  const model = state.model || '—';
  els.modelName.textContent = state.model;
  els.settingsModel.textContent = model;
  if (state.model) els.emptyModel.textContent = `You are chatting with ${state.model}. Answers stream in as they are written.`;
  const l = state.limits;
  const parts = [];
  if (l.max_new_tokens) parts.push(`${l.max_new_tokens.toLocaleString()} new tokens`);
  if (l.context_tokens) parts.push(`${l.context_tokens.toLocaleString()}-token context`);
  if (l.max_content_chars) parts.push(`${l.max_content_chars.toLocaleString()} characters per message`);
  els.settingsLimits.textContent = parts.join(' · ') || '—';
  if (l.max_new_tokens) {
    els.setMaxTokens.max = l.max_new_tokens;
    els.maxTokensHelp.textContent = `Up to ${l.max_new_tokens.toLocaleString()}. Empty uses the server default.`;
  }
}

// ---------------------------------------------------------------- conversations

function titleOf(conversation) {
  return (conversation?.title || '').trim() || state.titles[conversation?.id] || 'New chat';
}

let refreshTimer = 0;
function refreshConversationsSoon() {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refreshConversations, 300);
}

async function refreshConversations() {
  let data;
  try { data = await api('/api/conversations'); } catch { return; }
  const list = Array.isArray(data) ? data : (data?.conversations || data?.items || []);
  const known = new Set(list.map((c) => c.id));
  // Keep a conversation that started a moment ago but is not listed yet.
  const pending = state.conversations.filter((c) => !known.has(c.id)
    && [...state.requests.values()].some((r) => r.conversationId === c.id));
  state.conversations = [...pending, ...list];
  renderSidebar();
}

function renderSidebar() {
  const focusedId = document.activeElement?.closest?.('.conversation')?.dataset.id;
  const renaming = els.list.querySelector('.conversation-rename');
  if (renaming) return; // do not pull the field away from someone typing
  els.list.replaceChildren();
  for (const c of state.conversations) {
    const item = els.tplConversation.content.firstElementChild.cloneNode(true);
    item.dataset.id = c.id;
    const current = c.id === state.conversationId;
    item.setAttribute('aria-current', current ? 'true' : 'false');
    const title = titleOf(c);
    item.querySelector('.conversation-title').textContent = title;
    const open = item.querySelector('.conversation-open');
    open.title = title;
    if (current) open.setAttribute('aria-current', 'page');
    item.querySelector('[data-action="rename"]').setAttribute('aria-label', `Rename “${title}”`);
    item.querySelector('[data-action="delete"]').setAttribute('aria-label', `Delete “${title}”`);
    const exp = item.querySelector('[data-action="export"]');
    exp.href = `${convUrl(c.id)}/export?format=md`;
    exp.setAttribute('aria-label', `Export “${title}” as Markdown`);
    els.list.append(item);
  }
  els.listEmpty.hidden = state.conversations.length > 0;
  if (focusedId) els.list.querySelector(`[data-id="${CSS.escape(focusedId)}"] .conversation-open`)?.focus();
  updateHeader();
}

function updateHeader() {
  const current = state.conversations.find((c) => c.id === state.conversationId);
  const title = state.conversationId ? titleOf(current || { id: state.conversationId }) : 'New chat';
  els.title.textContent = title;
  document.title = state.conversationId ? `${title} · Chat` : 'Chat';
  els.exportMenu.hidden = !state.conversationId;
  if (state.conversationId) {
    els.exportMd.href = `${convUrl(state.conversationId)}/export?format=md`;
    els.exportJson.href = `${convUrl(state.conversationId)}/export?format=json`;
  }
}

function setCurrent(id) {
  state.conversationId = id;
  if (id) storage.set(KEY_CONVERSATION, id);
  else storage.remove(KEY_CONVERSATION);
  for (const item of els.list.children) {
    const current = item.dataset.id === id;
    item.setAttribute('aria-current', current ? 'true' : 'false');
    const open = item.querySelector('.conversation-open');
    if (current) open.setAttribute('aria-current', 'page');
    else open.removeAttribute('aria-current');
  }
  updateHeader();
}

function clearThread() {
  for (const node of [...els.thread.children]) if (node !== els.empty) node.remove();
}

function forgetConversation(id) {
  state.conversations = state.conversations.filter((c) => c.id !== id);
  delete state.titles[id];
  storage.set(KEY_TITLES, state.titles);
  if (state.conversationId === id) openConversation(null);
  renderSidebar();
}

async function openConversation(id, { keepError = false } = {}) {
  const token = ++state.viewToken;
  if (!keepError) clearError();
  setCurrent(id);
  clearThread();
  els.empty.hidden = !!id;
  state.follow = true;
  updateComposer();
  if (!id) return;
  let data;
  try {
    data = await api(convUrl(id));
  } catch (err) {
    if (token !== state.viewToken) return;
    if (err.status === 404) {
      forgetConversation(id);
    } else {
      showError(`Could not load this conversation: ${err.message}`);
    }
    return;
  }
  if (token !== state.viewToken) return;
  renderConversation(data?.conversation || data);
}

function renderConversation(conversation) {
  clearThread();
  const messages = (conversation.messages || []).filter((m) => m.role === 'user' || m.role === 'assistant');
  const live = [...state.requests.values()].filter((r) => !r.done && r.conversationId === state.conversationId);
  if (live.length) {
    // The live answer is drawn from the stream; drop the partial copy the store may hold.
    while (messages.length && messages[messages.length - 1].role === 'assistant') messages.pop();
  }
  for (const m of messages) {
    if (m.role === 'user') {
      appendUser(m.content ?? '');
    } else {
      const view = new AssistantMessage();
      els.thread.append(view.el);
      view.setText(m.content ?? '', true);
      view.finish({ reason: m.finish_reason ?? m.reason, timings: m.timings, usage: m.usage });
    }
  }
  for (const req of live) {
    if (req.kind === 'chat' && req.userEl && !messages.length) els.thread.append(req.userEl);
    els.thread.append(req.view.el);
  }
  els.empty.hidden = els.thread.querySelector('.msg') !== null;
  if (conversation.title && conversation.id) {
    const entry = state.conversations.find((c) => c.id === conversation.id);
    if (entry) entry.title = conversation.title;
    updateHeader();
  }
  updateComposer();
  requestAnimationFrame(() => { state.follow = true; scrollToBottom(); updateJump(); });
}

function startRename(item) {
  const id = item.dataset.id;
  const conversation = state.conversations.find((c) => c.id === id);
  const open = item.querySelector('.conversation-open');
  const input = document.createElement('input');
  input.className = 'conversation-rename';
  input.value = titleOf(conversation);
  input.maxLength = 200;
  input.setAttribute('aria-label', 'New title');
  open.hidden = true;
  item.querySelector('.conversation-actions').hidden = true;
  item.prepend(input);
  input.focus();
  input.select();
  let finished = false;
  const finish = async (save) => {
    if (finished) return;
    finished = true;
    const title = input.value.trim();
    input.remove();
    if (save && title && title !== titleOf(conversation)) {
      if (conversation) conversation.title = title;
      try {
        await api(convUrl(id), { method: 'PATCH', json: { title } });
      } catch (err) {
        showError(`Could not rename: ${err.message}`);
      }
    }
    renderSidebar();
    els.list.querySelector(`[data-id="${CSS.escape(id)}"] .conversation-open`)?.focus();
  };
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.isComposing && e.keyCode !== 229) { e.preventDefault(); finish(true); }
    if (e.key === 'Escape') { e.preventDefault(); e.stopPropagation(); finish(false); }
  });
  input.addEventListener('blur', () => finish(true));
}

async function deleteConversation(item) {
  const id = item.dataset.id;
  const conversation = state.conversations.find((c) => c.id === id);
  if (!confirm(`Delete “${titleOf(conversation)}”? This cannot be undone.`)) return;
  for (const req of state.requests.values()) {
    if (req.conversationId === id && !req.done) wsSend({ type: 'cancel', id: req.id });
  }
  try {
    await api(convUrl(id), { method: 'DELETE' });
  } catch (err) {
    if (err.status !== 404) {
      showError(`Could not delete: ${err.message}`);
      return;
    }
  }
  forgetConversation(id);
  announce('Conversation deleted.');
}

els.list.addEventListener('click', (e) => {
  const item = e.target.closest('.conversation');
  if (!item) return;
  const action = e.target.closest('[data-action]')?.dataset.action;
  if (action === 'rename') startRename(item);
  else if (action === 'delete') deleteConversation(item);
  else if (action === 'export') closeSidebar();
  else if (e.target.closest('.conversation-open')) {
    if (item.dataset.id !== state.conversationId) openConversation(item.dataset.id);
    closeSidebar();
    els.prompt.focus({ preventScroll: true });
  }
});

els.newChat.addEventListener('click', () => {
  openConversation(null);
  closeSidebar();
  els.prompt.focus();
});

// ---------------------------------------------------------------- sidebar drawer (small screens)

function openSidebar() {
  els.app.classList.add('sidebar-open');
  els.scrim.hidden = false;
  els.sidebarToggle.setAttribute('aria-expanded', 'true');
  els.newChat.focus();
}

function closeSidebar() {
  if (!els.app.classList.contains('sidebar-open')) return;
  els.app.classList.remove('sidebar-open');
  els.scrim.hidden = true;
  els.sidebarToggle.setAttribute('aria-expanded', 'false');
  if (els.sidebar.contains(document.activeElement)) els.sidebarToggle.focus();
}

els.sidebarToggle.addEventListener('click', () => {
  if (els.app.classList.contains('sidebar-open')) closeSidebar();
  else openSidebar();
});
els.sidebarClose.addEventListener('click', closeSidebar);
els.scrim.addEventListener('click', closeSidebar);

// ---------------------------------------------------------------- composer

let composing = false;

function autosize() {
  if (CSS.supports('field-sizing', 'content')) return;
  els.prompt.style.height = 'auto';
  els.prompt.style.height = `${Math.min(els.prompt.scrollHeight, window.innerHeight * 0.4)}px`;
}

els.prompt.addEventListener('compositionstart', () => { composing = true; });
els.prompt.addEventListener('compositionend', () => { composing = false; });
els.prompt.addEventListener('input', () => {
  autosize();
  updateComposer();
});

els.prompt.addEventListener('keydown', (e) => {
  if (e.key !== 'Enter' || e.shiftKey || e.altKey) return;
  // Enter that confirms an IME candidate must never send.
  if (e.isComposing || e.keyCode === 229 || composing) return;
  e.preventDefault();
  if (!activeInView().length) sendChat();
});

els.composer.addEventListener('submit', (e) => {
  e.preventDefault();
  sendChat();
});

els.stop.addEventListener('click', () => {
  stopStreaming();
  els.prompt.focus();
});

document.addEventListener('keydown', (e) => {
  if (e.key !== 'Escape' || e.defaultPrevented || e.isComposing || composing) return;
  if (els.settings.open) return;
  if (els.exportMenu.open) { els.exportMenu.open = false; return; }
  if (els.app.classList.contains('sidebar-open')) { closeSidebar(); return; }
  if (stopStreaming()) e.preventDefault();
});

document.addEventListener('click', (e) => {
  if (els.exportMenu.open && !els.exportMenu.contains(e.target)) els.exportMenu.open = false;
});

// ---------------------------------------------------------------- settings

function saveSettings() {
  storage.set(KEY_SETTINGS, state.settings);
}

function showSettings() {
  const s = state.settings;
  els.setSystem.value = s.system;
  els.setTemperature.value = s.temperature ?? SLIDER_DEFAULTS.temperature;
  els.setTopP.value = s.top_p ?? SLIDER_DEFAULTS.top_p;
  els.setMaxTokens.value = s.max_new_tokens ?? '';
  els.setSeed.value = s.seed ?? '';
  els.outTemperature.textContent = s.temperature === null ? 'default' : s.temperature.toFixed(2);
  els.outTopP.textContent = s.top_p === null ? 'default' : s.top_p.toFixed(2);
}

els.setSystem.addEventListener('input', () => { state.settings.system = els.setSystem.value; saveSettings(); });
els.setTemperature.addEventListener('input', () => {
  state.settings.temperature = Number(els.setTemperature.value);
  saveSettings();
  showSettings();
});
els.setTopP.addEventListener('input', () => {
  state.settings.top_p = Math.max(0.05, Number(els.setTopP.value));
  saveSettings();
  showSettings();
});
els.setMaxTokens.addEventListener('input', () => {
  const value = parseInt(els.setMaxTokens.value, 10);
  state.settings.max_new_tokens = Number.isFinite(value) && value >= 1 ? value : null;
  saveSettings();
});
els.setSeed.addEventListener('input', () => {
  const value = parseInt(els.setSeed.value, 10);
  state.settings.seed = Number.isInteger(value) && value >= 0 ? value : null;
  saveSettings();
});
els.settingsReset.addEventListener('click', () => {
  state.settings = { ...DEFAULT_SETTINGS };
  saveSettings();
  showSettings();
});
els.openSettings.addEventListener('click', () => {
  showSettings();
  closeSidebar();
  els.settings.showModal();
});
els.settings.addEventListener('click', (e) => {
  if (e.target === els.settings) els.settings.close(); // click on the backdrop
});

// ---------------------------------------------------------------- start

function init() {
  showSettings();
  showModel();
  connect();
  const saved = storage.get(KEY_CONVERSATION, null);
  if (typeof saved === 'string' && saved) {
    adoptInflight(saved);
    openConversation(saved);
  } else {
    updateHeader();
  }
  refreshConversations();
  updateComposer();
  if (matchMedia('(min-width: 821px)').matches) els.prompt.focus({ preventScroll: true });
}

init();

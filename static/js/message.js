// One message in the thread: the user's text, or an assistant answer with its status, stats and actions.
import { action as probabilitiesAction } from './tokens.js';
import { MarkdownView } from './markdown.js';
import { ICON_BRANCH, ICON_CONTINUE, ICON_COPY, ICON_EDIT, ICON_REGEN } from './icons.js';
import { fmtDuration } from './util.js';

/** Labels for `done` reasons worth showing; `stop` is the normal end and shows none. */
export const REASONS = {
  length: 'Length limit reached',
  cancelled: 'Stopped',
  timeout: 'Timed out',
  shutdown: 'Server restarting',
  error: 'Generation failed',
  edited: 'Edited by you',
};
const BAD_REASONS = ['error', 'timeout', 'shutdown'];
/** Answers cut short, which `continue` can extend (and stored ones left `interrupted` by a crash). */
const CONTINUABLE = ['length', 'cancelled', 'timeout', 'shutdown', 'interrupted'];

/** Attached files as a row of chips; each opens to show its text (as text, never HTML). */
export function fileChips(files) {
  const row = document.createElement('div');
  row.className = 'msg-files';
  for (const file of files || []) {
    const chip = document.createElement('details');
    chip.className = 'file-chip';
    chip.dataset.testid = 'attachment';
    const name = document.createElement('summary');
    name.textContent = file.name;
    const text = document.createElement('pre');
    text.textContent = file.text;
    chip.append(name, text);
    row.append(chip);
  }
  return row;
}

/** A user message with its files and an Edit action; its text is never interpreted as HTML. */
export function userMessage(content, files = []) {
  const article = document.createElement('article');
  article.className = 'msg msg-user';
  article.dataset.testid = 'message-user';
  article.setAttribute('aria-label', 'You');
  const main = document.createElement('div');
  main.className = 'msg-main';
  // The actions (versions, Edit) sit beside the bubble, not under it: no empty row between a
  // question and its answer.
  const row = document.createElement('div');
  row.className = 'msg-row';
  const body = document.createElement('div');
  body.className = 'msg-body';
  body.textContent = content;
  const meta = document.createElement('div');
  meta.className = 'msg-meta';
  meta.innerHTML = '<span class="msg-actions"><button type="button" class="icon-btn" data-action="branch" data-testid="branch"'
    + ` aria-label="Branch into a new chat" title="Branch into a new chat">${ICON_BRANCH}</button>`
    + '<button type="button" class="icon-btn" data-action="edit" data-testid="edit"'
    + ` aria-label="Edit" title="Edit">${ICON_EDIT}</button></span>`;
  row.append(meta, body);
  main.append(row);
  if (files.length) main.append(fileChips(files));
  article.append(main);
  article.content = content;
  article.files = files;
  return article;
}

/** Record a message element's stored id and versions, and show "< 2/3 >" when there are several. */
export function setIdentity(el, { id, versions, created_at: createdAt }) {
  el.dataset.id = id;
  el.versions = versions;
  showVersions(el, versions);
  if (createdAt) stamp(el, createdAt);
}

const WHEN = new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'short' });
const TODAY = new Intl.DateTimeFormat(undefined, { timeStyle: 'short' });

/** When ``seconds`` (Unix time) was: the time alone today, else the date and time. */
export function when(seconds) {
  const at = new Date(seconds * 1000);
  return (at.toDateString() === new Date().toDateString() ? TODAY : WHEN).format(at);
}

/** The time a message was written, in its meta row, shown on hover (and to screen readers always). */
function stamp(el, seconds) {
  const meta = el.querySelector('.msg-meta');
  if (!meta) return;
  let time = meta.querySelector('.msg-time');
  if (!time) {
    time = document.createElement('time');
    time.className = 'msg-time';
    time.dataset.testid = 'message-time';
    meta.append(time);
  }
  const at = new Date(seconds * 1000);
  time.dateTime = at.toISOString();
  time.textContent = when(seconds);
  time.title = WHEN.format(at);
}

/** The "< 2/3 >" switcher of ``versions`` in the message's meta row; with ``locked`` both arrows
 * are off (the version is still being written). */
function showVersions(el, versions, locked = false) {
  el.querySelector('.versions')?.remove();
  if (!versions || versions.count < 2) return;
  const box = document.createElement('span');
  box.className = 'versions';
  box.dataset.testid = 'versions';
  const button = (action, label, glyph, disabled) => {
    const b = document.createElement('button');
    b.type = 'button';
    b.className = 'icon-btn small';
    b.dataset.action = action;
    b.setAttribute('aria-label', label);
    b.textContent = glyph;
    b.disabled = disabled;
    return b;
  };
  const label = document.createElement('span');
  label.className = 'versions-label';
  label.textContent = `${versions.index + 1}/${versions.count}`;
  label.setAttribute('aria-label', `Version ${versions.index + 1} of ${versions.count}`);
  box.append(button('version-prev', 'Previous version', '‹', locked || versions.index === 0), label,
    button('version-next', 'Next version', '›', locked || versions.index === versions.count - 1));
  el.querySelector('.msg-meta').prepend(box);
}

/** Turn a user message into a text box with Save and Cancel: Save (or Enter) calls
 * ``submit(text)``, Cancel (or Esc) puts the message back. */
export function editInPlace(article, submit, { multiline = false, action = 'edit' } = {}) {
  if (article.querySelector('.msg-edit')) return;
  const body = article.querySelector('.msg-body');
  const form = document.createElement('div');
  form.className = 'msg-edit-form';
  const box = document.createElement('textarea');
  box.className = 'msg-edit';
  box.dataset.testid = 'edit-box';
  box.setAttribute('aria-label', multiline ? 'Edit the answer (Ctrl+Enter saves, Esc cancels)'
    : 'Edit message (Enter saves and sends, Esc cancels)');
  if (multiline) box.rows = Math.min(16, Math.max(4, (article.content || '').split('\n').length + 1));
  box.value = article.content;
  const actions = document.createElement('div');
  actions.className = 'msg-edit-actions';
  actions.innerHTML = '<button type="button" class="btn-secondary small" data-testid="edit-cancel">Cancel</button>'
    + '<button type="button" class="btn-primary small" data-testid="edit-save" title="Save and send (Enter)">Save</button>';
  const [cancel, save] = actions.querySelectorAll('button');
  form.append(box, actions);
  body.hidden = true;
  article.querySelector('.msg-meta').hidden = true;
  body.after(form);
  box.focus({ preventScroll: true });
  form.scrollIntoView({ block: 'nearest' }); // its whole box, top edge included (scroll-margin)
  box.setSelectionRange(box.value.length, box.value.length);
  const close = () => {
    form.remove();
    body.hidden = false;
    article.querySelector('.msg-meta').hidden = false;
  };
  const cancelled = () => {
    close();
    article.querySelector(`[data-action="${action}"]`)?.focus(); // back where the keyboard was
  };
  const done = () => {
    if (!box.value.trim()) return;
    const text = box.value.trimEnd();
    close();
    submit(text);
  };
  const refresh = () => { save.disabled = !box.value.trim(); };
  box.addEventListener('input', refresh);
  cancel.addEventListener('click', cancelled);
  save.addEventListener('click', done);
  box.addEventListener('keydown', (e) => {
    if (e.key === 'Escape') {
      e.preventDefault();
      e.stopPropagation();
      cancelled();
    } else if (e.key === 'Enter' && (multiline ? e.ctrlKey || e.metaKey : !e.shiftKey) && !e.isComposing
      && e.keyCode !== 229) {
      e.preventDefault();
      done();
    }
  });
}

/** Show new text in a user message (an edit was sent). */
export function setUserText(article, content) {
  article.content = content;
  article.querySelector('.msg-body').textContent = content;
}

/** A duration for people: "0.8 s", "12 s", "2 min 5 s". */
function formatSeconds(ms) {
  const s = ms / 1000;
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 60) return `${Math.round(s)} s`;
  return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

function span(className, text, testid) {
  const el = document.createElement('span');
  el.className = className;
  el.textContent = text;
  if (testid) el.dataset.testid = testid;
  return el;
}

let contextTokens = 0; // the server's context size, from `ready`

/** The context size answers are measured against (0: unknown, not shown); answers already drawn
 * (a conversation loaded before `ready`, or again after a reconnect) show their share at once. */
export function setContextTokens(n) {
  const size = Number.isInteger(n) && n > 0 ? n : 0;
  if (size === contextTokens) return;
  contextTokens = size;
  for (const el of document.querySelectorAll('.msg-assistant')) {
    const done = el.view?.done;
    if (!done || el.view.meta.querySelector('.msg-live')) continue;
    const line = stats(done.timings, done.usage);
    const old = el.view.meta.querySelector('[data-testid=stats]');
    if (old) old.textContent = line;
    else if (line) el.view.meta.append(span('msg-stats', line, 'stats'));
  }
}

/** How much of the context an answer's turn used: prompt and answer. */
function contextPart(usage) {
  const used = (usage?.prompt_tokens || 0) + (usage?.completion_tokens || 0);
  if (!contextTokens || !used) return '';
  return `${Math.max(1, Math.round((100 * used) / contextTokens))}% of the context`;
}

/** What a finished answer took: time to first token, speed, tokens, the context it filled. */
function stats(timings, usage) {
  const parts = [];
  if (timings && Number.isFinite(timings.ttft_ms)) parts.push(`${fmtDuration(timings.ttft_ms)} to first token`);
  if (timings && Number.isFinite(timings.tokens_per_s) && timings.tokens_per_s > 0) parts.push(`${timings.tokens_per_s.toFixed(1)} tokens/s`);
  if (usage && Number.isFinite(usage.completion_tokens)) parts.push(`${usage.completion_tokens} tokens`);
  const context = contextPart(usage);
  if (context) parts.push(context);
  return parts.join(' · ');
}

/** The figures of an answer Continue extended (``before``: its earlier {usage, timings}; ``after``:
 * the new part's `done`), as one answer, as the server stores them (chat/runs.py whole_answer). */
export function wholeAnswer(before, after) {
  const oldN = before?.usage?.completion_tokens;
  const newN = after?.usage?.completion_tokens;
  if (!Number.isInteger(oldN) || !Number.isInteger(newN)) return after;
  const usage = { ...after.usage, completion_tokens: oldN + newN, prompt_tokens: before.usage.prompt_tokens ?? after.usage.prompt_tokens };
  const timings = { ...(after.timings || {}) };
  const was = before.timings || {};
  if (Number.isFinite(was.ttft_ms)) timings.ttft_ms = was.ttft_ms;
  if (Number.isFinite(was.total_ms) && Number.isFinite(timings.total_ms)) timings.total_ms = was.total_ms + timings.total_ms;
  const parts = [[oldN, was.tokens_per_s], [newN, after.timings?.tokens_per_s]].filter(([n]) => n);
  if (parts.every(([, rate]) => Number.isFinite(rate) && rate > 0)) {
    const seconds = parts.reduce((sum, [n, rate]) => sum + n / rate, 0);
    if (seconds > 0) timings.tokens_per_s = (oldN + newN) / seconds;
  }
  return { ...after, usage, timings };
}

/** An assistant answer; ``el.view`` points back here, and ``text`` is its Markdown source. */
export class AssistantMessage {
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

  /** Show the waiting dots with a label (queue position, or thinking). */
  setThinking(label = '') {
    this.el.classList.add('streaming');
    this.el.dataset.state = 'waiting';
    this.el.setAttribute('aria-busy', 'true');
    this.status.hidden = false;
    this.status.innerHTML = '<span class="thinking" aria-hidden="true"><span></span><span></span><span></span></span>';
    this.status.append(span('status-text', label || 'Thinking…', 'thinking'));
    this.meta.replaceChildren();
    if (this.pendingVersions) showVersions(this.el, this.pendingVersions, true);
  }

  /** A thinking model's thinking (plain text), in a collapsible "Thinking" block above the answer: open
   * while ``live`` (it is thinking), closed once the answer begins, saying how long it thought
   * (``ms``: the stored duration; else measured here from its first piece). */
  setReasoning(text, live, ms) {
    let box = this.thinkingBox;
    if (!box) {
      box = this.thinkingBox = document.createElement('details');
      box.className = 'msg-thinking';
      box.dataset.testid = 'thinking-block';
      box.innerHTML = '<summary><span class="thinking-label" data-testid="thinking-label"></span></summary>'
        + '<div class="thinking-text" data-testid="thinking-text"></div>';
      box.open = live;
      this.thinkingFrom = performance.now();
      this.body.before(box);
    }
    box.querySelector('.thinking-text').textContent = text;
    const label = box.querySelector('.thinking-label');
    if (live) {
      if (box.dataset.state !== 'thinking') box.open = true;
      this.status.hidden = true;
      this.el.dataset.state = 'streaming';
      box.dataset.state = 'thinking';
      const seconds = Math.floor((performance.now() - this.thinkingFrom) / 1000); // as each piece arrives
      label.textContent = seconds >= 1 ? `Thinking… ${seconds} s` : 'Thinking…';
      return;
    }
    if (box.dataset.state !== 'done') {
      if (box.dataset.state === 'thinking' && this.text === '' && ms === undefined) return; // stopped while thinking: stays open
      box.open = false;
      box.dataset.state = 'done';
    }
    if (ms === undefined && this.thinkingMs === undefined) this.thinkingMs = performance.now() - this.thinkingFrom;
    if (ms !== undefined) this.thinkingMs = ms;
    label.textContent = `Thought for ${formatSeconds(this.thinkingMs)}`;
  }

  setText(text, final) {
    this.text = text;
    if (text) {
      this.status.hidden = true;
      if (!final) this.el.dataset.state = 'streaming';
    }
    this.markdown.update(text, final);
  }

  /** Mark the answer finished: reason, stats and the Copy/Regenerate/Continue actions. */
  finish({ reason, timings, usage, status, stored } = {}) {
    this.settle('done');
    if (this.thinkingBox && Number.isFinite(timings?.thinking_ms)) { // the server's measure of how long it thought
      this.thinkingMs = timings.thinking_ms;
      this.thinkingBox.querySelector('.thinking-label').textContent = `Thought for ${formatSeconds(this.thinkingMs)}`;
      this.thinkingBox.dataset.state = this.text ? 'done' : 'cut'; // stopped inside it: stays open
    }
    this.el.dataset.reason = reason || '';
    this.done = { reason, timings, usage, status };
    this.meta.replaceChildren();
    if (REASONS[reason]) {
      const bad = BAD_REASONS.includes(reason) ? ' bad' : '';
      this.meta.append(span(`msg-reason${bad}`, REASONS[reason], 'done-reason'));
    }
    // The store was full: the server keeps the answer in memory and saves it when space returns.
    if (stored === false) this.meta.append(span('msg-reason bad', 'not saved yet: storage is full', 'not-stored'));
    const line = stats(timings, usage);
    if (line) this.meta.append(span('msg-stats', line, 'stats'));
    const actions = document.createElement('span');
    actions.className = 'msg-actions';
    actions.innerHTML = `<button type="button" class="icon-btn" data-action="copy-message">${ICON_COPY}<span>Copy</span></button>`
      + `<button type="button" class="icon-btn" data-action="regenerate" data-testid="regenerate" hidden>${ICON_REGEN}<span>Regenerate</span></button>`
      + `<button type="button" class="icon-btn" data-action="edit-answer" data-testid="edit-answer" title="Edit this answer: your text becomes a new version">${ICON_EDIT}<span>Edit</span></button>`
      + `<button type="button" class="icon-btn" data-action="branch" data-testid="branch" title="Branch into a new chat: this conversation up to here">${ICON_BRANCH}<span>Branch</span></button>`;
    if (CONTINUABLE.includes(status === 'interrupted' ? status : reason)) {
      actions.insertAdjacentHTML('beforeend', `<button type="button" class="icon-btn" data-action="continue" data-testid="continue">${ICON_CONTINUE}<span>Continue</span></button>`);
    }
    if (this.tokens?.length) actions.append(probabilitiesAction(this));
    this.meta.prepend(actions);
    if (this.el.versions) setIdentity(this.el, { id: this.el.dataset.id, versions: this.el.versions });
    else if (this.pendingVersions) showVersions(this.el, this.pendingVersions, true);
  }

  /** While it streams: how many tokens so far (a delta is about one) and how many a second. */
  showLive(tokens, perSecond) {
    let line = this.meta.querySelector('.msg-live');
    if (!line) {
      line = span('msg-stats msg-live', '', 'live-stats');
      this.meta.append(line);
    }
    line.textContent = `≈ ${tokens} tokens so far${perSecond > 0 ? ` · ${perSecond.toFixed(1)} tokens/s` : ''}`;
  }

  /** Say that a new version of this answer is being written (``label``), or no longer (null);
   * the answer stays readable meanwhile. */
  setRegenerating(label) {
    this.el.classList.toggle('superseded', Boolean(label));
    this.el.querySelector('.msg-regenerating')?.remove();
    if (!label) return;
    const note = span('msg-regenerating', '', 'regenerating');
    note.innerHTML = '<span class="thinking" aria-hidden="true"><span></span><span></span><span></span></span>';
    note.append(span('status-text', label));
    this.body.before(note);
  }

  /** While it streams, show which version it will be (``index`` of ``count``, arrows off). */
  showPendingVersion(index, count) {
    this.pendingVersions = { index, count };
    showVersions(this.el, this.pendingVersions, true);
  }

  /** Stream more text onto this answer (continue): its text so far stays. */
  resume() {
    this.el.classList.add('streaming');
    this.el.dataset.state = 'streaming';
    this.el.setAttribute('aria-busy', 'true');
    this.meta.replaceChildren();
    this.el.querySelector('.token-view')?.remove(); // its tokens are about to grow
  }

  /** Mark the answer failed with ``text``, keeping what had arrived. */
  fail(text) {
    this.settle('error');
    this.el.classList.add('is-error');
    if (!this.text) this.body.textContent = text;
    else this.meta.append(span('msg-reason bad', text));
  }

  settle(state) {
    this.el.classList.remove('streaming');
    this.el.dataset.state = state;
    this.el.removeAttribute('aria-busy');
    this.status.hidden = true;
  }
}

// One message in the thread: the user's text, or an assistant answer with its status, stats and actions.
import { MarkdownView } from './markdown.js';
import { ICON_COPY, ICON_REGEN } from './icons.js';
import { fmtDuration } from './util.js';

/** Labels for `done` reasons worth showing; `stop` is the normal end and shows none. */
export const REASONS = {
  length: 'Length limit reached',
  cancelled: 'Stopped',
  timeout: 'Timed out',
  shutdown: 'Server restarting',
  error: 'Generation failed',
};
const BAD_REASONS = ['error', 'timeout', 'shutdown'];

/** A user message; its text is never interpreted as HTML. */
export function userMessage(content) {
  const article = document.createElement('article');
  article.className = 'msg msg-user';
  article.dataset.testid = 'message-user';
  article.setAttribute('aria-label', 'You');
  const body = document.createElement('div');
  body.className = 'msg-body';
  body.textContent = content;
  article.append(body);
  return article;
}

function span(className, text, testid) {
  const el = document.createElement('span');
  el.className = className;
  el.textContent = text;
  if (testid) el.dataset.testid = testid;
  return el;
}

/** What a finished answer took: time to first token, speed, tokens. */
function stats(timings, usage) {
  const parts = [];
  if (timings && Number.isFinite(timings.ttft_ms)) parts.push(`${fmtDuration(timings.ttft_ms)} to first token`);
  if (timings && Number.isFinite(timings.tokens_per_s) && timings.tokens_per_s > 0) parts.push(`${timings.tokens_per_s.toFixed(1)} tokens/s`);
  if (usage && Number.isFinite(usage.completion_tokens)) parts.push(`${usage.completion_tokens} tokens`);
  return parts.join(' · ');
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
  }

  setText(text, final) {
    this.text = text;
    if (text) {
      this.status.hidden = true;
      if (!final) this.el.dataset.state = 'streaming';
    }
    this.markdown.update(text, final);
  }

  /** Mark the answer finished: reason, stats and the Copy/Regenerate actions. */
  finish({ reason, timings, usage } = {}) {
    this.settle('done');
    this.el.dataset.reason = reason || '';
    this.meta.replaceChildren();
    if (REASONS[reason]) {
      const bad = BAD_REASONS.includes(reason) ? ' bad' : '';
      this.meta.append(span(`msg-reason${bad}`, REASONS[reason], 'done-reason'));
    }
    const line = stats(timings, usage);
    if (line) this.meta.append(span('msg-stats', line, 'stats'));
    const actions = document.createElement('span');
    actions.className = 'msg-actions';
    actions.innerHTML = `<button type="button" class="icon-btn" data-action="copy-message">${ICON_COPY}<span>Copy</span></button>`
      + `<button type="button" class="icon-btn" data-action="regenerate" data-testid="regenerate" hidden>${ICON_REGEN}<span>Regenerate</span></button>`;
    this.meta.prepend(actions);
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

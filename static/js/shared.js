// A shared conversation (/s/<token>), read-only: its messages from the page's JSON, drawn like the
// chat's, with the model and date above, each answer cut short marked (Stopped...), Copy that says so,
// and Continue in my chats, which copies it into the reader's own chats.
import { renderMarkdown } from './markdown.js';

const REASONS = { length: 'Length limit reached', cancelled: 'Stopped', timeout: 'Timed out',
  shutdown: 'Server restarting', error: 'Generation failed' };
const data = JSON.parse(document.getElementById('shared-data').textContent);
const thread = document.getElementById('thread');
const WHEN = new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'short' });

function message({ role, content, attachments, reason, status, created_at: createdAt }) {
  const article = document.createElement('article');
  article.className = `msg msg-${role === 'user' ? 'user' : 'assistant'}`;
  article.dataset.testid = `shared-${role}`;
  article.setAttribute('aria-label', role === 'user' ? 'User' : 'Assistant');
  const body = document.createElement('div');
  if (role === 'user') {
    body.className = 'msg-body';
    body.textContent = content; // the user's words as they typed them
  } else {
    body.className = 'msg-body markdown';
    body.append(renderMarkdown(content));
  }
  if (attachments?.length) {
    const files = document.createElement('p');
    files.className = 'shared-files';
    files.textContent = `Attached: ${attachments.map((a) => a.name).join(', ')}`;
    body.prepend(files);
  }
  const main = document.createElement('div');
  main.className = 'msg-main';
  main.append(body);
  const cut = REASONS[reason] || (status === 'interrupted' ? 'Interrupted' : '');
  if (role === 'assistant' && (cut || createdAt)) {
    const meta = document.createElement('div');
    meta.className = 'msg-meta';
    if (cut) {
      const mark = document.createElement('span');
      mark.className = `msg-reason${reason === 'cancelled' || reason === 'length' ? '' : ' bad'}`;
      mark.dataset.testid = 'shared-reason';
      mark.textContent = cut;
      meta.append(mark);
    }
    main.append(meta);
  }
  if (createdAt) article.title = WHEN.format(new Date(createdAt * 1000));
  article.append(main);
  return article;
}

const meta = document.getElementById('shared-meta');
const when = document.createElement('time');
when.dateTime = new Date(data.updated_at * 1000).toISOString();
when.textContent = WHEN.format(new Date(data.updated_at * 1000));
meta.append(`${data.model} · `, when);

thread.replaceChildren(...data.messages.map(message));

// The code blocks' Copy buttons work here too, and say so.
thread.addEventListener('click', async (e) => {
  const button = e.target.closest('[data-copy="code"]');
  if (!button) return;
  const code = button.closest('.code-block')?.querySelector('code')?.textContent ?? '';
  const label = button.querySelector('span') || button;
  const before = label.textContent;
  let copied = true;
  try { await navigator.clipboard.writeText(code); } catch { copied = false; }
  button.classList.toggle('copied', copied);
  label.textContent = copied ? 'Copied' : 'Copy failed';
  document.getElementById('shared-status').textContent = copied ? 'Copied to clipboard' : 'Could not copy';
  setTimeout(() => { button.classList.remove('copied'); label.textContent = before; }, 1500);
});

// Continue in my chats: a copy becomes the reader's own conversation, opened in the chat page.
const button = document.getElementById('shared-continue');
button.addEventListener('click', async () => {
  button.disabled = true;
  const status = document.getElementById('shared-status');
  status.textContent = 'Copying into your chats…';
  try {
    const res = await fetch(`${location.pathname}/continue`, {
      method: 'POST', credentials: 'same-origin', headers: { 'Content-Type': 'application/json' }, body: '{}',
    });
    const body = await res.json();
    if (!res.ok) throw new Error(body?.error?.message || `${res.status}`);
    location.assign(`/c/${encodeURIComponent(body.id)}`);
  } catch (err) {
    status.textContent = `Could not copy it: ${err.message}`;
    button.disabled = false;
  }
});

// A shared conversation (/s/<token>), read-only: its messages from the page's JSON, drawn like the chat's.
import { renderMarkdown } from './markdown.js';

const data = JSON.parse(document.getElementById('shared-data').textContent);
const thread = document.getElementById('thread');

function message({ role, content, attachments }) {
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
  article.append(main);
  return article;
}

thread.replaceChildren(...data.messages.map(message));
// The code blocks' Copy buttons work here too.
thread.addEventListener('click', async (e) => {
  const button = e.target.closest('[data-copy="code"]');
  if (!button) return;
  const code = button.closest('.code-block')?.querySelector('code')?.textContent ?? '';
  try { await navigator.clipboard.writeText(code); } catch { /* not a secure context */ }
});

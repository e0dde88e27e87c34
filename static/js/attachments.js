// Files attached to the next message: picked, dropped or pasted. Text files are read here (the
// content is sniffed: NUL bytes, invalid UTF-8, since a file's type and name often lie); PDF, DOCX,
// HTML and CSV are read to text by the server; images are refused, saying what is accepted. Each
// chip shows the file's tokens (and a PDF's pages); the live count adds the draft's tokens.
import * as api from './api.js';
import { els } from './dom.js';
import * as composer from './composer.js';
import * as socket from './socket.js';

const MAX_FILES = 8;
const MAX_NAME = 200;
// Types that are never text: refused without reading them.
const BINARY_TYPES = /^(image|audio|video|font)\/|^application\/(pdf|zip|gzip|x-tar|x-7z|x-rar|octet-stream|msword|vnd\.)/;
const DOCUMENTS = /\.(pdf|docx|html?|csv)$/i; // read to text by the server
const IMAGES = /\.(png|jpe?g|gif|webp|bmp|heic|svg|tiff?|avif)$/i;
const ACCEPTED = 'text files (code, Markdown, JSON…), PDF, DOCX, HTML and CSV';
const SNIFF_BYTES = 8192;
const COUNT_AFTER_MS = 400; // the draft's tokens are counted once typing pauses this long

let files = []; // {name, text, tokens, pages, reading}
let draftTokens = 0;
let countTimer = 0;
let countToken = 0;

/** The files to send with the next message: [{name, text}] (those still being read are not). */
export const current = () => files.filter((f) => !f.reading).map(({ name, text }) => ({ name, text }));

/** The name of a file still being read by the server, or null. */
export const reading = () => files.find((f) => f.reading)?.name || null;

export function clear() {
  files = [];
  render();
}

/** Give back the files of a refused message, unless others were attached meanwhile. */
export function restore(list) {
  if (list?.length && !files.length) {
    files = list.map(({ name, text }) => ({ name, text, tokens: null }));
    for (const file of files) countFile(file);
    render();
  }
}

export function remove(index) {
  files.splice(index, 1);
  render();
}

/** The file's text, or null when it looks binary. */
async function sniff(file) {
  const bytes = new Uint8Array(await file.arrayBuffer());
  if (bytes.subarray(0, SNIFF_BYTES).includes(0)) return null;
  try {
    return new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    return null;
  }
}

/** Attach ``list`` (a FileList or array of File); what cannot be attached is said in the error line. */
export async function add(list) {
  const problems = [];
  const max = socket.limits().max_content_chars;
  for (const file of list) {
    const name = (file.name || 'pasted.txt').slice(0, MAX_NAME);
    if (files.length >= MAX_FILES) {
      problems.push(`At most ${MAX_FILES} files can go with one message.`);
      break;
    }
    if (max && file.size > max * 4) {
      problems.push(`“${name}” is too large to attach (the limit is ${max.toLocaleString()} characters per message).`);
      continue;
    }
    if (IMAGES.test(name) || file.type.startsWith('image/')) {
      problems.push(`“${name}” is an image: this model reads text only. Attach ${ACCEPTED}.`);
      continue;
    }
    if (DOCUMENTS.test(name)) {
      readOnServer(file, name);
      continue;
    }
    const text = BINARY_TYPES.test(file.type) ? null : await sniff(file);
    if (text === null) {
      problems.push(`“${name}” is not a file this page can read. Attach ${ACCEPTED}.`);
      continue;
    }
    const entry = { name, text, tokens: null };
    files.push(entry);
    countFile(entry);
  }
  render();
  if (problems.length) composer.showError(problems.join(' '));
  else composer.clearError();
}

/** A document (PDF, DOCX, HTML, CSV): its chip says it is being read while the server reads it. */
async function readOnServer(file, name) {
  const entry = { name, text: '', tokens: null, reading: true };
  files.push(entry);
  render();
  try {
    const read = await api.readDocument(file, name);
    Object.assign(entry, { text: read.text, tokens: read.tokens, pages: read.pages, truncated: read.truncated,
      reading: false });
    if (read.truncated) composer.showError(`Only the beginning of “${name}” fits in one message; the rest is left out.`);
  } catch (err) {
    files = files.filter((f) => f !== entry);
    composer.showError(err.message);
  }
  render();
}

/** The tokens of a text file, from the server's tokenizer (a chip shows them once known). */
async function countFile(entry) {
  try {
    entry.tokens = (await api.countTokens(entry.text)).tokens;
  } catch { return; }
  render();
}

/** Count the draft's tokens once typing pauses (for the live count beside the box). */
export function countDraft() {
  clearTimeout(countTimer);
  countTimer = setTimeout(async () => {
    const asked = ++countToken;
    const text = els.prompt.value;
    let tokens = 0;
    if (text.trim()) {
      try { tokens = (await api.countTokens(text)).tokens; } catch { return; }
    }
    if (asked !== countToken) return;
    draftTokens = tokens;
    showCount();
  }, COUNT_AFTER_MS);
}

/** The draft plus the attachments, in tokens, against the model's context (hidden when nothing is typed
 * or attached, or when the server cannot count). */
function showCount() {
  const context = socket.limits().context_tokens;
  const known = files.every((f) => f.reading || typeof f.tokens === 'number') && typeof draftTokens === 'number';
  const total = (draftTokens || 0) + files.reduce((n, f) => n + (f.tokens || 0), 0);
  const show = known && total > 0 && Boolean(context);
  els.tokenCount.hidden = !show;
  if (!show) return;
  els.tokenCount.textContent = `${total.toLocaleString()} / ${context.toLocaleString()} tokens`;
  els.tokenCount.title = 'This message and its attachments, in tokens, against the model’s context';
  els.tokenCount.classList.toggle('over', total > context);
}

/** What a chip says after the file's name: being read, pages, tokens. */
function facts(file) {
  if (file.reading) return 'reading…';
  const parts = [];
  if (file.pages) parts.push(`${file.pages} ${file.pages === 1 ? 'page' : 'pages'}`);
  if (typeof file.tokens === 'number') parts.push(`${file.tokens.toLocaleString()} tokens`);
  return parts.join(' · ');
}

function chip(file, index) {
  const el = document.createElement('span');
  el.className = `file-chip pending${file.reading ? ' reading' : ''}`;
  el.dataset.testid = 'pending-attachment';
  const name = document.createElement('span');
  name.className = 'chip-name';
  name.textContent = file.name;
  name.title = `${file.text.length.toLocaleString()} characters`;
  el.append(name);
  const about = facts(file);
  if (about) {
    const small = document.createElement('span');
    small.className = 'chip-facts';
    small.dataset.testid = 'chip-facts';
    small.textContent = about;
    el.append(small);
  }
  const x = document.createElement('button');
  x.type = 'button';
  x.className = 'chip-remove';
  x.dataset.remove = String(index);
  x.setAttribute('aria-label', `Remove ${file.name}`);
  x.textContent = '×';
  el.append(x);
  return el;
}

function render() {
  els.attachments.replaceChildren(...files.map(chip));
  els.attachments.hidden = files.length === 0;
  showCount();
}

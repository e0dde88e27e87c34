// Files attached to the next message: picked, dropped or pasted. Only text is accepted: the
// content is sniffed (NUL bytes, invalid UTF-8), since a file's type and name often lie.
import { els } from './dom.js';
import * as composer from './composer.js';
import * as socket from './socket.js';

const MAX_FILES = 8;
const MAX_NAME = 200;
// Types that are never text: refused without reading them.
const BINARY_TYPES = /^(image|audio|video|font)\/|^application\/(pdf|zip|gzip|x-tar|x-7z|x-rar|octet-stream|msword|vnd\.)/;
const SNIFF_BYTES = 8192;

let files = [];

/** The files to send with the next message: [{name, text}]. */
export const current = () => files.map(({ name, text }) => ({ name, text }));

export function clear() {
  files = [];
  render();
}

/** Give back the files of a refused message, unless others were attached meanwhile. */
export function restore(list) {
  if (list?.length && !files.length) {
    files = list.map(({ name, text }) => ({ name, text }));
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
    const text = BINARY_TYPES.test(file.type) ? null : await sniff(file);
    if (text === null) {
      problems.push(`“${name}” is not a text file, so it cannot be attached. Attach text such as code, notes, CSV or Markdown.`);
      continue;
    }
    files.push({ name, text });
  }
  render();
  if (problems.length) composer.showError(problems.join(' '));
  else composer.clearError();
}

function chip(file, index) {
  const el = document.createElement('span');
  el.className = 'file-chip pending';
  el.dataset.testid = 'pending-attachment';
  const name = document.createElement('span');
  name.textContent = file.name;
  name.title = `${file.text.length.toLocaleString()} characters`;
  const x = document.createElement('button');
  x.type = 'button';
  x.className = 'chip-remove';
  x.dataset.remove = String(index);
  x.setAttribute('aria-label', `Remove ${file.name}`);
  x.textContent = '×';
  el.append(name, x);
  return el;
}

function render() {
  els.attachments.replaceChildren(...files.map(chip));
  els.attachments.hidden = files.length === 0;
}

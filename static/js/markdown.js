// Markdown for assistant answers: marked -> DOMPurify, with highlight.js code blocks.
// Rendering is incremental: finished top-level blocks keep their DOM nodes while an
// answer streams, so only the growing last block is rebuilt (no flicker, no jumps).
import { Marked } from '../vendor/marked/marked.esm.js';
import DOMPurify from '../vendor/dompurify/purify.es.js';
import hljs from '../vendor/highlight/highlight.min.js';
import { ICON_COPY } from './icons.js';
import { mathExtensions } from './math.js';

const ESCAPES = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);

// Auto-detection runs once a block is complete, over the languages answers mostly hold: plain
// prose scores as CSS or INI among every bundled grammar, so those need their label.
const AUTO_HIGHLIGHT_MAX = 20000;
const AUTO_LANGUAGES = ['python', 'javascript', 'typescript', 'json', 'bash', 'shell', 'sql', 'xml', 'c', 'cpp',
  'java', 'go', 'rust', 'ruby', 'php', 'yaml', 'diff'];

const PURIFY = {
  USE_PROFILES: { html: true, mathMl: true },
  // MathML comes only from KaTeX (math.js); DOMPurify's MathML profile still checks every element.
  FORBID_TAGS: ['style', 'form', 'input', 'button', 'textarea', 'select', 'option', 'iframe', 'img', 'video', 'audio', 'svg',
    'maction', 'annotation-xml'],
  FORBID_ATTR: ['style', 'id', 'name'],
  RETURN_DOM_FRAGMENT: true,
};

DOMPurify.addHook('afterSanitizeAttributes', (node) => {
  if (node.tagName === 'A' && node.hasAttribute('href')) {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer nofollow');
  }
});

function codeBlock(text, lang, live) {
  const language = (lang || '').trim().split(/\s+/)[0].toLowerCase();
  let html = null;
  let label = language;
  if (language && hljs.getLanguage(language)) {
    html = hljs.highlight(text, { language, ignoreIllegals: true }).value;
  } else if (!language && !live && text.length <= AUTO_HIGHLIGHT_MAX) {
    const result = hljs.highlightAuto(text, AUTO_LANGUAGES.filter((name) => hljs.getLanguage(name)));
    if (result.language && result.relevance >= 5) {
      html = result.value;
      label = result.language;
    }
  }
  if (html === null) html = escapeHtml(text);
  const cls = label ? ` language-${escapeHtml(label.replace(/[^\w+#.-]/g, ''))}` : '';
  return `<div class="code-block"><div class="code-head"><span class="code-lang">${escapeHtml(label || 'text')}</span></div>`
    + `<pre tabindex="0"><code class="hljs${cls}">${html}</code></pre></div>`;
}

// A tool call the model made (<tool_call>{"name", "arguments"}</tool_call>): a collapsible block
// showing the function's name, its arguments inside; still open at the end while it streams.
const TOOL_CALL = {
  name: 'toolCall',
  level: 'block',
  start(src) { const i = src.indexOf('<tool_call>'); return i < 0 ? undefined : i; },
  tokenizer(src) {
    const m = /^<tool_call>[ \t]*\n?([\s\S]*?)(?:\n?<\/tool_call>[ \t]*(?:\n+|$)|$)/.exec(src);
    if (m) return { type: 'toolCall', raw: m[0], body: m[1] };
    return undefined;
  },
  renderer({ body }) {
    let name = '…';
    let args = body;
    try {
      const call = JSON.parse(body);
      name = String(call.name);
      args = JSON.stringify(call.arguments ?? {}, null, 2);
    } catch { /* still streaming, or not JSON: shown as written */ }
    return `<details class="tool-call"><summary>Tool call: <code>${escapeHtml(name)}</code></summary>`
      + `<pre><code>${escapeHtml(args)}</code></pre></details>`;
  },
};

function makeMarked(live) {
  return new Marked({
    extensions: [...mathExtensions, TOOL_CALL],
    gfm: true,
    breaks: false,
    async: false,
    renderer: {
      // Raw HTML written by the model is shown as text, never interpreted.
      html({ text }) { return escapeHtml(text); },
      code({ text, lang }) { return codeBlock(text, lang, live); },
      // Images become links: no remote fetches (tracking pixels) from model output.
      image({ href, text }) {
        return `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`;
      },
    },
  });
}

const markedFinal = makeMarked(false);
const markedLive = makeMarked(true);

function addCopyButtons(root) {
  for (const head of root.querySelectorAll('.code-head')) {
    const button = document.createElement('button');
    button.type = 'button';
    button.className = 'copy-btn';
    button.dataset.copy = 'code';
    button.setAttribute('aria-label', 'Copy code');
    button.innerHTML = `${ICON_COPY}<span>Copy</span>`;
    head.append(button);
  }
}

function toFragment(html) {
  const fragment = DOMPurify.sanitize(html, PURIFY);
  addCopyButtons(fragment);
  return fragment;
}

/** Render a whole Markdown string to a sanitized DocumentFragment. */
export function renderMarkdown(text) {
  return toFragment(markedFinal.parse(String(text ?? '')));
}

/** Render a whole Markdown string to sanitized HTML (a string). */
export function renderMarkdownToHtml(text) {
  const div = document.createElement('div');
  div.append(renderMarkdown(text));
  return div.innerHTML;
}

/**
 * Keeps a container in sync with a growing Markdown text, one DOM node per top-level block.
 *
 * While an answer streams, the blocks before the last one are finished: their source is
 * never lexed again. Each update lexes only the text from the start of the last block on,
 * so a frame costs the size of that block, not of the whole answer (which made streaming
 * into a long answer quadratic). The final update lexes the whole text once, so anything
 * that depends on the whole document (reference links) comes out right.
 */
export class MarkdownView {
  constructor(container) {
    this.el = container;
    this.blocks = [];
    this.text = null;
    this.final = false;
    this.stableChars = 0; // source characters covered by finished blocks
    this.stableBlocks = 0; // how many of this.blocks they are
  }

  update(text, final = false) {
    if (text === this.text && final === this.final) return;
    const grows = !final && this.text !== null && !this.final && text.startsWith(this.text.slice(0, this.stableChars));
    this.text = text;
    this.final = final;
    if (!grows) {
      this.stableChars = 0;
      this.stableBlocks = 0;
    }
    const tail = text.slice(this.stableChars);
    const lexed = markedFinal.lexer(tail);
    const tokens = lexed.filter((t) => t.type !== 'space');
    const hasLinks = Object.keys(lexed.links || {}).length > 0;
    tokens.forEach((token, n) => {
      const i = this.stableBlocks + n;
      const live = !final && n === tokens.length - 1;
      const key = `${live ? 'L' : 'F'}${token.raw}`;
      let block = this.blocks[i];
      if (block && block.key === key && !live && !(final && hasLinks)) return;
      const list = [token];
      list.links = lexed.links;
      const fragment = toFragment((live ? markedLive : markedFinal).parser(list));
      if (!block) {
        const node = document.createElement('div');
        node.className = 'md-block';
        this.el.append(node);
        block = this.blocks[i] = { node, key };
      }
      block.key = key;
      block.node.replaceChildren(fragment);
    });
    for (const stale of this.blocks.splice(this.stableBlocks + tokens.length)) stale.node.remove();
    if (!final) this.advance(lexed, tail.length);
  }

  /** Mark every block but the last as finished, when the lexer's tokens cover the tail exactly. */
  advance(lexed, tailLength) {
    let lastBlock = -1;
    lexed.forEach((t, i) => { if (t.type !== 'space') lastBlock = i; });
    if (lastBlock <= 0) return;
    const covered = lexed.reduce((sum, t) => sum + t.raw.length, 0);
    if (covered !== tailLength) return; // the lexer rewrote the source (e.g. CR LF): no shortcut
    for (const token of lexed.slice(0, lastBlock)) {
      this.stableChars += token.raw.length;
      if (token.type !== 'space') this.stableBlocks += 1;
    }
  }
}

/** The plain text of a code block next to a copy button. */
export function codeTextFor(button) {
  const code = button.closest('.code-block')?.querySelector('pre code');
  return code ? code.textContent : '';
}

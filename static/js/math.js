// Math in answers: $…$ and \(…\) inline, $$…$$ and \[…\] displayed, rendered by KaTeX (loaded as a
// classic script, window.katex) as MathML only: the browser lays it out, no styles or fonts needed.

const ESCAPES = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);

// Bounds on what one formula may cost (a model can write anything).
const MAX_TEX_CHARS = 4000;
const OPTIONS = { output: 'mathml', throwOnError: false, strict: 'ignore', trust: false, maxSize: 20, maxExpand: 200 };

/** ``tex`` as MathML; the TeX itself (as text) when KaTeX is missing or refuses it. */
export function renderTex(tex, displayMode) {
  const katex = globalThis.katex;
  const source = `<code class="math-source">${escapeHtml(tex)}</code>`;
  if (!katex || tex.length > MAX_TEX_CHARS) return source;
  try {
    // The TeX source KaTeX keeps in an <annotation> would show as text once the sanitizer drops
    // its <semantics> wrapper; Copy takes the answer's Markdown anyway.
    return katex.renderToString(tex, { ...OPTIONS, displayMode }).replace(/<annotation\b[^>]*>[\s\S]*?<\/annotation>/g, '');
  } catch {
    return source;
  }
}

// A whole block: $$…$$ or \[…\] alone (a formula inside a paragraph is the inline rule's).
const BLOCK = /^(?:\$\$([\s\S]+?)\$\$|\\\[([\s\S]+?)\\\])[ \t]*(?:\n+|$)/;
// Inline: $$…$$ (displayed), \(…\), or $…$ that does not look like money: no space just inside
// either $, no digit right after the closing one ("$5 and $10" stays text).
const INLINE = /^(?:\$\$([\s\S]+?)\$\$|\\\(([\s\S]+?)\\\)|\$(?![\s$])((?:\\.|[^\\$\n])+?)(?<![\s\\])\$(?!\d))/;

/** The marked extensions for math. */
export const mathExtensions = [
  {
    name: 'mathBlock',
    level: 'block',
    tokenizer(src) {
      const m = BLOCK.exec(src);
      if (m) return { type: 'mathBlock', raw: m[0], text: (m[1] ?? m[2]).trim() };
      return undefined;
    },
    renderer(token) {
      return `<div class="math math-block">${renderTex(token.text, true)}</div>\n`;
    },
  },
  {
    name: 'mathInline',
    level: 'inline',
    start(src) {
      const at = src.search(/\$|\\\(/);
      return at < 0 ? undefined : at;
    },
    tokenizer(src) {
      const m = INLINE.exec(src);
      if (!m) return undefined;
      const display = m[1] !== undefined;
      return { type: 'mathInline', raw: m[0], text: (m[1] ?? m[2] ?? m[3]).trim(), display };
    },
    renderer(token) {
      const cls = token.display ? 'math math-display' : 'math';
      return `<span class="${cls}">${renderTex(token.text, token.display)}</span>`;
    },
  },
];

// Model output -> safe HTML: Markdown (GitHub flavour) with highlighted code, sanitized by DOMPurify so that
// nothing in a model's answer can run script or restyle the page.
import DOMPurify from 'dompurify';
import hljs from 'highlight.js/lib/common';
import { Marked } from 'marked';

const ESCAPES = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
export const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);

const AUTO_DETECT_LIMIT = 5000; // characters: longer unlabelled code is shown plain

function highlight(text, lang) {
  const name = (lang || '').trim().split(/\s+/)[0].toLowerCase();
  if (name && hljs.getLanguage(name)) {
    return { html: hljs.highlight(text, { language: name, ignoreIllegals: true }).value, name };
  }
  if (!name && text.length <= AUTO_DETECT_LIMIT) {
    const auto = hljs.highlightAuto(text);
    if (auto.language && auto.relevance >= 5) return { html: auto.value, name: auto.language };
  }
  return { html: escapeHtml(text), name: name || 'text' };
}

const marked = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    code({ text, lang }) {
      const { html, name } = highlight(text, lang);
      return `<pre><code class="hljs" data-lang="${escapeHtml(name)}">${html}\n</code></pre>\n`;
    },
  },
});

DOMPurify.addHook('afterSanitizeAttributes', (node) => {
  if (node.tagName === 'A') {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer nofollow');
  }
});

const PURIFY = {
  USE_PROFILES: { html: true },
  FORBID_TAGS: ['style', 'form', 'button', 'textarea', 'select', 'option', 'dialog'],
  FORBID_ATTR: ['style', 'id', 'name', 'autofocus'],
};

/** Markdown -> sanitized HTML (a string for innerHTML). */
export function renderMarkdown(src) {
  return DOMPurify.sanitize(marked.parse(src || '', { async: false }), PURIFY);
}

/** Give each highlighted code block in `root` a header with its language and a copy button. */
export function decorateCodeBlocks(root) {
  for (const pre of root.querySelectorAll('pre')) {
    const code = pre.querySelector('code');
    if (!code || pre.parentElement.classList.contains('code-block')) continue;
    const box = document.createElement('div');
    box.className = 'code-block';
    const head = document.createElement('div');
    head.className = 'code-head';
    const lang = document.createElement('span');
    lang.className = 'code-lang';
    lang.textContent = code.dataset.lang || 'text';
    const copy = document.createElement('button');
    copy.type = 'button';
    copy.className = 'copy-code';
    copy.textContent = 'Copy';
    head.append(lang, copy);
    pre.replaceWith(box);
    box.append(head, pre);
  }
}

/**
 * Split Qwen3-style reasoning from the answer: `<think>...</think>answer`, or `...</think>answer` when the
 * chat template opened the block itself. `thinking` is true while the block is still open.
 */
export function splitReasoning(text) {
  const open = text.indexOf('<think>');
  const close = text.indexOf('</think>');
  if (open >= 0 && text.slice(0, open).trim() === '' && (close < 0 || close > open)) {
    if (close < 0) return { reasoning: text.slice(open + 7), answer: '', thinking: true };
    return { reasoning: text.slice(open + 7, close), answer: text.slice(close + 8), thinking: false };
  }
  if (close >= 0 && open < 0) {
    return { reasoning: text.slice(0, close), answer: text.slice(close + 8), thinking: false };
  }
  return { reasoning: '', answer: text, thinking: false };
}

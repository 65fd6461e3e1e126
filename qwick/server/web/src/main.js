// The chat page: conversations in a sidebar, streamed answers with their speed, settings, themes.
import { listModels, streamChat } from './api.js';
import { decorateCodeBlocks, renderMarkdown, splitReasoning } from './markdown.js';
import { MetricsPanel } from './metrics.js';
import { applyTheme, effectiveTheme, loadSettings, responseFormat, saveSettings } from './settings.js';
import * as store from './store.js';

const $ = (id) => document.getElementById(id);
const NEW_TITLE = 'New chat';
const EXAMPLES = [
  'Write a quicksort in Python.',
  '用一句话解释什么是快速排序。',
  'Make a Markdown table comparing three sorting algorithms.',
];

const state = {
  settings: loadSettings(),
  models: [],
  conversations: [], // every stored conversation, the most recently updated first
  current: null, // the conversation on screen
  running: null, // { controller, conv, msg } while an answer streams
};

// ---- small helpers ------------------------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === 'dataset') Object.assign(node.dataset, v);
    else if (k in node) node[k] = v;
    else node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}

function showBanner(text, kind = 'error') {
  const banner = $('banner');
  banner.textContent = text;
  banner.className = kind;
  banner.hidden = !text;
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // plain http on another host has no clipboard API: the old way still works there
    const area = el('textarea', { value: text });
    document.body.append(area);
    area.select();
    document.execCommand('copy');
    area.remove();
  }
}

function flash(button, text) {
  const old = button.textContent;
  button.textContent = text;
  setTimeout(() => (button.textContent = old), 1200);
}

const fmtMs = (ms) => (ms == null ? '–' : ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${ms.toFixed(0)} ms`);

function titleFrom(text) {
  const line = text.trim().split('\n')[0];
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || NEW_TITLE;
}

// ---- one message on screen ----------------------------------------------------------------------------

function statsLine(msg) {
  const s = msg.stats;
  const live = msg.live;
  const parts = [];
  let title = '';
  if (s) {
    parts.push(`TTFT ${fmtMs(s.ttftMs)}`);
    if (s.tps != null) parts.push(`${s.tps.toFixed(1)} tok/s`);
    parts.push(`${s.tokens} tokens`);
    title =
      `server: queue ${fmtMs(s.queueMs)}, prefill ${fmtMs(s.prefillMs)}, decode ${fmtMs(s.decodeMs)}, ` +
      `end to end ${fmtMs(s.e2eMs)}; prompt ${s.promptTokens} tokens (${s.cachedTokens} cached); ` +
      `first token seen by this page after ${fmtMs(s.clientTtftMs)}`;
  } else if (live) {
    parts.push(`TTFT ${fmtMs(live.ttftMs)}`);
    if (live.tps != null) parts.push(`${live.tps.toFixed(1)} tok/s`);
    parts.push(`${live.tokens} tokens`);
    title = 'measured by this page while the answer streams';
  }
  if (msg.state === 'stopped') parts.push('stopped');
  return { text: parts.join(' · '), title };
}

function updateAssistant(view, msg) {
  const split = msg.reasoning
    ? { reasoning: msg.reasoning, answer: msg.content, thinking: msg.state === 'streaming' && !msg.content }
    : splitReasoning(msg.content);
  view.dataset.state = msg.state || 'done';
  const details = view.querySelector('.reasoning');
  details.hidden = !split.reasoning.trim();
  details.querySelector('summary').textContent = split.thinking ? 'Thinking…' : 'Reasoning';
  if (!details.hidden) details.querySelector('.md').innerHTML = renderMarkdown(split.reasoning);
  const content = view.querySelector('.content');
  if (view.classList.contains('raw')) {
    content.replaceChildren(el('pre', { className: 'raw-text', textContent: msg.content }));
  } else {
    content.innerHTML = renderMarkdown(split.answer.replace(/^\s*\n/, ''));
    decorateCodeBlocks(content);
  }
  if (msg.state === 'streaming' && !msg.content && !msg.reasoning) {
    content.replaceChildren(el('span', { className: 'typing', textContent: '…' }));
  }
  const stats = view.querySelector('.stats');
  const line = statsLine(msg);
  stats.textContent = line.text;
  stats.title = line.title;
  if (msg.stats) {
    stats.dataset.ttftMs = String(msg.stats.ttftMs ?? '');
    stats.dataset.tps = String(msg.stats.tps ?? '');
  }
  const error = view.querySelector('.error');
  error.hidden = !msg.error;
  error.textContent = msg.error || '';
}

function messageView(msg) {
  const view = el('div', { className: `msg msg-${msg.role}`, dataset: { id: msg.id } });
  if (msg.role === 'user') {
    view.append(
      el('div', { className: 'bubble', textContent: msg.content }),
      el(
        'div',
        { className: 'actions' },
        el('button', { type: 'button', className: 'edit', textContent: 'Edit', title: 'Edit and resend' }),
      ),
    );
    return view;
  }
  const details = el('details', { className: 'reasoning' }, el('summary'), el('div', { className: 'md' }));
  view.append(
    details,
    el('div', { className: 'content md' }),
    el('div', { className: 'error', role: 'alert' }),
    el(
      'div',
      { className: 'foot' },
      el('span', { className: 'stats' }),
      el(
        'span',
        { className: 'actions' },
        el('button', { type: 'button', className: 'copy', textContent: 'Copy', title: 'Copy the answer' }),
        el('button', { type: 'button', className: 'raw-toggle', textContent: 'Raw', title: 'Raw text / Markdown' }),
        el('button', { type: 'button', className: 'regenerate', textContent: 'Regenerate' }),
      ),
    ),
  );
  updateAssistant(view, msg);
  return view;
}

const viewOf = (msg) => document.querySelector(`.msg[data-id="${CSS.escape(msg.id)}"]`);

function nearBottom() {
  const box = $('messages');
  return box.scrollHeight - box.scrollTop - box.clientHeight < 120;
}

function scrollToBottom() {
  const box = $('messages');
  box.scrollTop = box.scrollHeight;
}

function renderMessages() {
  const box = $('messages');
  const conv = state.current;
  $('title').textContent = conv && conv.messages.length ? conv.title : 'qwick';
  if (!conv || !conv.messages.length) {
    const model = state.settings.model || state.models[0] || 'the model';
    box.replaceChildren(
      el(
        'div',
        { className: 'empty' },
        el('h2', { textContent: 'Ask anything' }),
        el('p', {
          className: 'muted',
          textContent: `Answers stream from ${model} on this server; each shows its time to first token and tokens/s.`,
        }),
        el(
          'div',
          { className: 'examples' },
          ...EXAMPLES.map((text) => el('button', { type: 'button', className: 'example', textContent: text })),
        ),
      ),
    );
    return;
  }
  box.replaceChildren(...conv.messages.map(messageView));
  scrollToBottom();
}

// ---- the sidebar --------------------------------------------------------------------------------------

function matches(conv, query) {
  if (!query) return true;
  const q = query.toLowerCase();
  return conv.title.toLowerCase().includes(q) || conv.messages.some((m) => m.content.toLowerCase().includes(q));
}

function renderSidebar() {
  const query = $('search').value.trim();
  const items = state.conversations
    .filter((c) => matches(c, query))
    .map((c) =>
      el(
        'li',
        { className: `conv${state.current && c.id === state.current.id ? ' active' : ''}`, dataset: { id: c.id } },
        el('button', { type: 'button', className: 'conv-open', textContent: c.title, title: c.title }),
        el('button', { type: 'button', className: 'conv-rename icon', textContent: '✎', title: 'Rename' }),
        el('button', { type: 'button', className: 'conv-delete icon', textContent: '✕', title: 'Delete' }),
      ),
    );
  if (!items.length) {
    items.push(el('li', { className: 'muted none', textContent: query ? 'No match' : 'No conversations yet' }));
  }
  $('conv-list').replaceChildren(...items);
}

function openConversation(conv) {
  state.current = conv;
  renderSidebar();
  renderMessages();
  document.body.classList.remove('side-open');
}

function newConversation() {
  const now = Date.now();
  openConversation({ id: store.newId(), title: NEW_TITLE, created: now, updated: now, messages: [] });
  $('input').focus();
}

async function persist(conv) {
  if (conv.deleted) return; // deleted while its answer was streaming
  conv.updated = Date.now();
  if (!state.conversations.includes(conv)) state.conversations.unshift(conv);
  state.conversations.sort((a, b) => b.updated - a.updated);
  await store.saveConversation(conv);
  renderSidebar();
}

function startRename(li, conv) {
  const input = el('input', { className: 'conv-title-input', value: conv.title, 'aria-label': 'Conversation name' });
  li.replaceChildren(input);
  input.focus();
  input.select();
  let done = false;
  const finish = async (save) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    if (save && title) {
      conv.title = title;
      await store.saveConversation(conv);
      if (conv === state.current) $('title').textContent = title;
    }
    renderSidebar();
  };
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.isComposing) finish(true);
    if (e.key === 'Escape') {
      e.stopPropagation();
      finish(false);
    }
  });
  input.addEventListener('blur', () => finish(true));
}

async function removeConversation(conv) {
  if (!confirm(`Delete "${conv.title}"?`)) return;
  conv.deleted = true;
  if (state.running && state.running.conv === conv) stop();
  await store.deleteConversation(conv.id);
  state.conversations = state.conversations.filter((c) => c !== conv);
  if (state.current === conv) {
    if (state.conversations.length) openConversation(state.conversations[0]);
    else newConversation();
  } else {
    renderSidebar();
  }
}

async function exportAll() {
  const doc = await store.exportDocument();
  const blob = new Blob([JSON.stringify(doc, null, 2)], { type: 'application/json' });
  const url = URL.createObjectURL(blob);
  const day = new Date().toISOString().slice(0, 10);
  el('a', { href: url, download: `qwick-chats-${day}.json` }).click();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

async function importFile(file) {
  try {
    const added = await store.importDocument(JSON.parse(await file.text()));
    state.conversations = await store.listConversations();
    renderSidebar();
    showBanner(`Imported ${added} conversation${added === 1 ? '' : 's'}.`, 'info');
  } catch (e) {
    showBanner(`Import failed: ${e.message}`);
  }
}

// ---- generation ---------------------------------------------------------------------------------------

function requestBody(conv, msg) {
  const s = state.settings;
  const messages = [];
  if (s.systemPrompt.trim()) messages.push({ role: 'system', content: s.systemPrompt });
  for (const m of conv.messages.slice(0, conv.messages.indexOf(msg))) {
    if (m.role === 'assistant') {
      const answer = m.reasoning ? m.content : splitReasoning(m.content).answer;
      if (m.state === 'error' || !answer.trim()) continue;
      messages.push({ role: 'assistant', content: answer });
    } else {
      messages.push({ role: m.role, content: m.content });
    }
  }
  const body = {
    messages,
    temperature: Number(s.temperature),
    top_p: Number(s.topP),
    stream_options: { include_usage: true, continuous_usage_stats: true },
  };
  const model = s.model || state.models[0];
  if (model) body.model = model;
  if (Number(s.maxTokens) > 0) body.max_tokens = Math.floor(Number(s.maxTokens));
  const format = responseFormat(s);
  if (format) body.response_format = format;
  return body;
}

function serverStats(t, clientTtftMs) {
  return {
    ttftMs: t.ttft_ms,
    tps: t.tpot_ms ? 1000 / t.tpot_ms : null,
    tokens: t.completion_tokens,
    queueMs: t.queue_ms,
    prefillMs: t.prefill_ms,
    decodeMs: t.decode_ms,
    e2eMs: t.e2e_ms,
    promptTokens: t.prompt_tokens,
    cachedTokens: t.cached_tokens,
    clientTtftMs,
  };
}

function setRunning(running) {
  $('send').hidden = running;
  $('stop').hidden = !running;
  document.body.classList.toggle('running', running);
}

async function generate(conv, msg) {
  const controller = new AbortController();
  state.running = { controller, conv, msg };
  setRunning(true);
  Object.assign(msg, { content: '', reasoning: '', state: 'streaming', stats: null, live: null, error: null });
  const started = performance.now();
  let firstAt = null;
  let tokens = 0;
  let queued = false;
  const paint = () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      const view = viewOf(msg);
      // once the answer is over, the final update (after it is saved) draws it
      if (!view || !state.running || state.running.msg !== msg) return;
      const follow = nearBottom();
      updateAssistant(view, msg);
      if (follow) scrollToBottom();
    });
  };
  paint();
  try {
    const body = requestBody(conv, msg);
    for await (const chunk of streamChat(body, { apiKey: state.settings.apiKey, signal: controller.signal })) {
      const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      const piece = delta.content || '';
      const thought = delta.reasoning_content || delta.reasoning || '';
      if ((piece || thought) && firstAt == null) firstAt = performance.now();
      msg.content += piece;
      msg.reasoning += thought;
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      else if (piece || thought) tokens += 1;
      if (chunk.qwick) msg.stats = serverStats(chunk.qwick, firstAt == null ? null : firstAt - started);
      if (firstAt != null) {
        const seconds = (performance.now() - firstAt) / 1000;
        msg.live = {
          ttftMs: firstAt - started,
          tokens,
          tps: tokens > 1 && seconds > 0.05 ? (tokens - 1) / seconds : null,
        };
      }
      paint();
    }
    msg.state = 'done';
  } catch (e) {
    if (controller.signal.aborted) {
      msg.state = 'stopped';
    } else {
      msg.state = 'error';
      msg.error = e.message;
    }
  } finally {
    state.running = null;
    setRunning(false);
    await persist(conv);
    const view = viewOf(msg);
    if (view) updateAssistant(view, msg);
  }
}

function stop() {
  if (state.running) state.running.controller.abort();
}

async function send(text) {
  if (!text.trim() || state.running) return;
  const conv = state.current;
  if (!conv.messages.length && conv.title === NEW_TITLE) conv.title = titleFrom(text);
  conv.messages.push({ id: store.newId(), role: 'user', content: text });
  const msg = { id: store.newId(), role: 'assistant', content: '', state: 'streaming' };
  conv.messages.push(msg);
  await persist(conv);
  renderMessages();
  await generate(conv, msg);
}

async function regenerate(msg) {
  const conv = state.current;
  if (state.running) return;
  conv.messages.splice(conv.messages.indexOf(msg));
  const fresh = { id: store.newId(), role: 'assistant', content: '', state: 'streaming' };
  conv.messages.push(fresh);
  renderMessages();
  await generate(conv, fresh);
}

function startEdit(view, msg) {
  if (state.running) return;
  const area = el('textarea', { className: 'edit-box', value: msg.content, rows: 3 });
  const save = el('button', { type: 'button', className: 'primary save-edit', textContent: 'Save & send' });
  const cancel = el('button', { type: 'button', textContent: 'Cancel' });
  view.replaceChildren(area, el('div', { className: 'actions' }, cancel, save));
  area.focus();
  cancel.addEventListener('click', renderMessages);
  const submit = async () => {
    const text = area.value;
    if (!text.trim()) return;
    const conv = state.current;
    msg.content = text;
    conv.messages.splice(conv.messages.indexOf(msg) + 1);
    const fresh = { id: store.newId(), role: 'assistant', content: '', state: 'streaming' };
    conv.messages.push(fresh);
    await persist(conv);
    renderMessages();
    await generate(conv, fresh);
  };
  save.addEventListener('click', submit);
  area.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
      e.preventDefault();
      submit();
    }
  });
}

// ---- settings -----------------------------------------------------------------------------------------

function fillModelSelect() {
  const select = $('set-model');
  const names = state.models.length ? state.models : [state.settings.model].filter(Boolean);
  select.replaceChildren(...names.map((n) => el('option', { value: n, textContent: n })));
  select.value = state.settings.model || names[0] || '';
}

function openSettings() {
  const s = state.settings;
  fillModelSelect();
  $('set-system').value = s.systemPrompt;
  $('set-temperature').value = s.temperature;
  $('set-top-p').value = s.topP;
  $('set-max-tokens').value = s.maxTokens;
  $('set-json').checked = s.jsonMode;
  $('set-schema').value = s.jsonSchema;
  $('set-schema').setCustomValidity('');
  $('schema-box').hidden = !s.jsonMode;
  $('set-api-key').value = s.apiKey;
  $('settings').showModal();
}

function readSettings() {
  const schema = $('set-schema');
  schema.setCustomValidity('');
  const next = {
    ...state.settings,
    model: $('set-model').value,
    systemPrompt: $('set-system').value,
    temperature: Number($('set-temperature').value || 0),
    topP: Math.min(Math.max(Number($('set-top-p').value || 1), 0.01), 1),
    maxTokens: $('set-max-tokens').value,
    jsonMode: $('set-json').checked,
    jsonSchema: schema.value,
    apiKey: $('set-api-key').value.trim(),
  };
  try {
    responseFormat(next);
  } catch (e) {
    schema.setCustomValidity(e.message);
    schema.reportValidity();
    return null;
  }
  return next;
}

async function loadModels() {
  try {
    state.models = await listModels(state.settings.apiKey);
    if (!state.settings.model || !state.models.includes(state.settings.model)) {
      state.settings.model = state.models[0] || '';
    }
    $('model-name').textContent = state.settings.model;
    showBanner('');
  } catch (e) {
    showBanner(`Could not list the models: ${e.message}`);
  }
}

// ---- wiring -------------------------------------------------------------------------------------------

function autosize() {
  const input = $('input');
  input.style.height = 'auto';
  input.style.height = `${Math.min(input.scrollHeight, 240)}px`;
}

function submitInput() {
  const input = $('input');
  const text = input.value;
  if (!text.trim() || state.running) return;
  input.value = '';
  autosize();
  send(text);
}

function bind(metrics) {
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    submitInput();
  });
  $('input').addEventListener('input', autosize);
  $('input').addEventListener('keydown', (e) => {
    // isComposing / 229: Enter that confirms a Chinese (IME) candidate must not send
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
      e.preventDefault();
      submitInput();
    }
  });
  $('stop').addEventListener('click', stop);
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Escape' && state.running && !$('settings').open) {
      e.preventDefault();
      stop();
    } else if ((e.ctrlKey || e.metaKey) && e.shiftKey && e.key.toLowerCase() === 'o') {
      e.preventDefault();
      newConversation();
    }
  });

  $('messages').addEventListener('click', (e) => {
    const button = e.target.closest('button');
    if (!button) return;
    if (button.classList.contains('example')) {
      send(button.textContent);
      return;
    }
    if (button.classList.contains('copy-code')) {
      copyText(button.closest('.code-block').querySelector('code').textContent).then(() => flash(button, 'Copied'));
      return;
    }
    const view = button.closest('.msg');
    const msg = view && state.current.messages.find((m) => m.id === view.dataset.id);
    if (!msg) return;
    if (button.classList.contains('copy')) {
      const text = msg.reasoning ? msg.content : splitReasoning(msg.content).answer;
      copyText(text.trim()).then(() => flash(button, 'Copied'));
    } else if (button.classList.contains('raw-toggle')) {
      view.classList.toggle('raw');
      button.textContent = view.classList.contains('raw') ? 'Markdown' : 'Raw';
      updateAssistant(view, msg);
    } else if (button.classList.contains('regenerate')) {
      regenerate(msg);
    } else if (button.classList.contains('edit')) {
      startEdit(view, msg);
    }
  });

  $('new-chat').addEventListener('click', newConversation);
  $('search').addEventListener('input', renderSidebar);
  $('conv-list').addEventListener('click', (e) => {
    const button = e.target.closest('button');
    const li = e.target.closest('li.conv');
    const conv = li && state.conversations.find((c) => c.id === li.dataset.id);
    if (!button || !conv) return;
    if (button.classList.contains('conv-open')) openConversation(conv);
    else if (button.classList.contains('conv-rename')) startRename(li, conv);
    else if (button.classList.contains('conv-delete')) removeConversation(conv);
  });
  $('export').addEventListener('click', exportAll);
  $('import').addEventListener('click', () => $('import-file').click());
  $('import-file').addEventListener('change', (e) => {
    const file = e.target.files[0];
    e.target.value = '';
    if (file) importFile(file);
  });

  $('menu').addEventListener('click', () => document.body.classList.toggle('side-open'));
  $('scrim').addEventListener('click', () => document.body.classList.remove('side-open'));
  $('toggle-theme').addEventListener('click', () => {
    state.settings.theme = effectiveTheme(state.settings) === 'dark' ? 'light' : 'dark';
    saveSettings(state.settings);
    applyTheme(state.settings);
  });
  const showMetrics = (show) => {
    $('metrics-panel').hidden = !show;
    $('toggle-metrics').setAttribute('aria-pressed', String(show));
    if (show) metrics.start();
    else metrics.stop();
  };
  $('toggle-metrics').addEventListener('click', () => {
    state.settings.showMetrics = $('metrics-panel').hidden;
    saveSettings(state.settings);
    showMetrics(state.settings.showMetrics);
  });
  showMetrics(state.settings.showMetrics);

  $('open-settings').addEventListener('click', openSettings);
  $('set-json').addEventListener('change', (e) => ($('schema-box').hidden = !e.target.checked));
  $('set-schema').addEventListener('input', (e) => e.target.setCustomValidity(''));
  $('settings-form').addEventListener('submit', (e) => {
    if (e.submitter && e.submitter.value !== 'save') return;
    const next = readSettings();
    if (!next) {
      e.preventDefault();
      return;
    }
    const keyChanged = next.apiKey !== state.settings.apiKey;
    state.settings = next;
    saveSettings(next);
    $('model-name').textContent = next.model;
    if (keyChanged) loadModels();
  });
}

async function main() {
  applyTheme(state.settings);
  const metrics = new MetricsPanel($('metrics-panel'));
  bind(metrics);
  const [convs] = await Promise.all([store.listConversations(), loadModels()]);
  for (const conv of convs) {
    // an answer that was streaming when the page went away is kept as stopped
    for (const m of conv.messages) if (m.state === 'streaming') m.state = 'stopped';
  }
  state.conversations = convs;
  if (convs.length) openConversation(convs[0]);
  else newConversation();
  document.body.dataset.ready = 'true';
}

main().catch((e) => showBanner(`The chat page failed to start: ${e.message}`));

// Conversations in IndexedDB: one record per conversation, its messages inside.
// A conversation: { id, title, created, updated, messages: [{ id, role, content, reasoning?, stats?,
// state?, error? }] }.

const DB_NAME = 'qwick-chat';
const STORE = 'conversations';

let dbPromise = null;

function db() {
  if (!dbPromise) {
    dbPromise = new Promise((resolve, reject) => {
      const req = indexedDB.open(DB_NAME, 1);
      req.onupgradeneeded = () => req.result.createObjectStore(STORE, { keyPath: 'id' });
      req.onsuccess = () => resolve(req.result);
      req.onerror = () => reject(req.error);
    });
  }
  return dbPromise;
}

async function run(mode, fn) {
  const tx = (await db()).transaction(STORE, mode);
  const req = fn(tx.objectStore(STORE));
  return new Promise((resolve, reject) => {
    tx.oncomplete = () => resolve(req ? req.result : undefined);
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error);
  });
}

export function newId() {
  return crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random().toString(36).slice(2)}`;
}

/** All conversations, the most recently updated first. */
export async function listConversations() {
  const all = await run('readonly', (s) => s.getAll());
  return all.sort((a, b) => b.updated - a.updated);
}

export function saveConversation(conv) {
  // Structured clone of a plain copy: live objects may carry non-cloneable fields.
  return run('readwrite', (s) => s.put(JSON.parse(JSON.stringify(conv))));
}

export function deleteConversation(id) {
  return run('readwrite', (s) => s.delete(id));
}

/** The JSON document that Export writes and Import reads. */
export async function exportDocument() {
  return {
    format: 'qwick-chat',
    version: 1,
    exported: new Date().toISOString(),
    conversations: await listConversations(),
  };
}

/** Import conversations from an exported document (or a bare array); returns how many were added. */
export async function importDocument(doc) {
  const list = Array.isArray(doc) ? doc : doc && doc.conversations;
  if (!Array.isArray(list)) throw new Error('not a qwick chat export (no "conversations" list)');
  const existing = new Set((await listConversations()).map((c) => c.id));
  let added = 0;
  for (const raw of list) {
    if (!raw || !Array.isArray(raw.messages)) continue;
    const messages = raw.messages
      .filter((m) => m && ['user', 'assistant', 'system'].includes(m.role))
      .map((m) => ({ ...m, id: m.id || newId(), content: String(m.content ?? '') }));
    const now = Date.now();
    const conv = {
      id: raw.id && !existing.has(raw.id) ? String(raw.id) : newId(),
      title: String(raw.title || 'Imported chat'),
      created: Number(raw.created) || now,
      updated: Number(raw.updated) || now,
      messages,
    };
    existing.add(conv.id);
    await saveConversation(conv);
    added += 1;
  }
  return added;
}

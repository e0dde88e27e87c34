// The HTTP API (/api/conversations, /api/search), as the page uses it.
const url = (id) => `/api/conversations/${encodeURIComponent(id)}`;

/** JSON from the server; a failure throws an Error with the server's message, status and code. */
async function call(path, { method = 'GET', json } = {}) {
  const init = { method, credentials: 'same-origin', headers: { Accept: 'application/json' } };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers['Content-Type'] = 'application/json';
  }
  const res = await fetch(path, init);
  if (!res.ok) {
    let detail = null;
    try { detail = (await res.json()).error; } catch { /* not JSON: a proxy's error page */ }
    const err = new Error(detail?.message || `${res.status} ${res.statusText}`);
    err.status = res.status;
    err.code = detail?.code;
    throw err;
  }
  return res.json();
}

/** This client's conversations, pinned first, then newest first (a list of {id, title, pinned, ...});
 * ``view`` 'archived' or 'trash' lists those instead. */
export const listConversations = (view = 'main') => call(view === 'main' ? '/api/conversations'
  : `/api/conversations?view=${view}`);
/** Bring a conversation back from the trash; returns it (without messages). */
export const restoreConversation = (id) => call(`${url(id)}/restore`, { method: 'POST', json: {} });
/** Delete a conversation for good (from the trash too). */
export const purgeConversation = (id) => call(`${url(id)}?forever=1`, { method: 'DELETE' });
/** ``action`` ('trash', 'restore', 'archive', 'unarchive', 'delete') on several; returns {ids: changed}. */
export const bulk = (action, ids) => call('/api/conversations/bulk', { method: 'POST', json: { action, ids } });

/** Several conversations as one JSON file (Import takes it whole): a Blob and its file name. */
export async function exportSeveral(ids) {
  const res = await fetch('/api/conversations/export', {
    method: 'POST', credentials: 'same-origin',
    headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ ids, format: 'json' }),
  });
  if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
  const name = /filename="([^"]+)"/.exec(res.headers.get('Content-Disposition') || '')?.[1] || 'conversations.json';
  return { blob: await res.blob(), name };
}
/** One conversation with its messages. */
export const getConversation = (id) => call(url(id));
/** Change a conversation's title, pinned, system, params or model; returns it (without messages). */
export const updateConversation = (id, changes) => call(url(id), { method: 'PATCH', json: changes });
export const deleteConversation = (id) => call(url(id), { method: 'DELETE' });
/** Where to download a conversation as ``md`` or ``json``. */
export const exportUrl = (id, format) => `${url(id)}/export?format=${format}`;
/** Make the path through ``messageId`` active (switching versions); returns the conversation. */
export const setActive = (id, messageId) => call(`${url(id)}/active`, { method: 'POST', json: { message_id: messageId } });
/** Create a conversation from an export or a ``messages`` list; returns {id}. */
export const importConversation = (body) => call('/api/conversations/import', { method: 'POST', json: body });
/** Full-text search over this client's messages: {results: [{conversation_id, title, message_id, snippet, highlights}]}. */
export const search = (q) => call(`/api/search?q=${encodeURIComponent(q)}`);

/** A document (PDF, DOCX, HTML, CSV) read to text by the server: {name, text, pages, chars, tokens, truncated}. */
export async function readDocument(file, name) {
  const res = await fetch(`/api/documents?name=${encodeURIComponent(name)}`, {
    method: 'POST', credentials: 'same-origin', headers: { 'Content-Type': 'application/octet-stream' }, body: file,
  });
  let body = null;
  try { body = await res.json(); } catch { /* a proxy's page */ }
  if (!res.ok) {
    if (res.status === 413 && !body) throw new Error(`“${name}” is too large to attach.`);
    throw new Error(body?.error?.message || `Could not read “${name}” (${res.status}).`);
  }
  return body;
}

/** How many tokens ``text`` is for the model: {tokens} (null when the server cannot say). */
export const countTokens = (text) => call('/api/tokens', { method: 'POST', json: { text } });

/** A new chat holding conversation ``id`` down to ``messageId``: {id}. */
export const branch = (id, messageId) => call(`${url(id)}/branch`, { method: 'POST', json: { message_id: messageId } });

/** Save ``content`` as a new version of answer ``messageId``; returns the conversation. */
export const editAnswer = (id, messageId, content) => call(`${url(id)}/messages/${encodeURIComponent(messageId)}`,
  { method: 'PUT', json: { content } });

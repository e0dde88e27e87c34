// The conversations HTTP API (/api/conversations), as the page uses it.
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

/** This client's conversations, newest first (a list of {id, title, ...}). */
export const listConversations = () => call('/api/conversations');
/** One conversation with its messages. */
export const getConversation = (id) => call(url(id));
export const renameConversation = (id, title) => call(url(id), { method: 'PATCH', json: { title } });
export const deleteConversation = (id) => call(url(id), { method: 'DELETE' });
/** Where to download a conversation as ``md`` or ``json``. */
export const exportUrl = (id, format) => `${url(id)}/export?format=${format}`;

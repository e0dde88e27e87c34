// The address bar: /c/<id> is a conversation, / a new chat. Switching pushes an entry, so
// reload, bookmarks and Back/Forward bring a person to the conversation they were in.

const PATH = /^\/c\/([^/]+)\/?$/;

/** The conversation id in the address, or null (a new chat). */
export function idFromPath() {
  const match = location.pathname.match(PATH);
  if (!match) return null;
  try { return decodeURIComponent(match[1]); } catch { return null; }
}

const pathOf = (id) => (id ? `/c/${encodeURIComponent(id)}` : '/');

/** Show ``id`` in the address: a new history entry, or with ``replace`` the current one. */
export function show(id, { replace = false } = {}) {
  const path = pathOf(id);
  if (location.pathname === path) return;
  if (replace) history.replaceState({ id }, '', path);
  else history.pushState({ id }, '', path);
}

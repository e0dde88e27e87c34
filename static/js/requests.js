// Requests in flight: one record per chat, edit, regenerate or continue id, its deltas in order, and how it completes.
import { tabStorage as storage } from './util.js';

// The answer this tab was streaming when it was left, so its reload can resume it (each tab its own).
const KEY_INFLIGHT = 'chat.inflight';

const requests = new Map();

/**
 * Track a request. ``view`` is its AssistantMessage; ``userEl`` the user message it added (chat)
 * with ``files``; ``oldView`` the answer it replaces (regenerate); ``prefix`` the text a continued
 * answer had; ``reload`` to undo a refusal by showing the stored conversation again (edit,
 * continue); ``started``/``sent`` for one adopted after a reload.
 */
export function add({
  id, conversationId, view, content = '', files = [], userEl = null, oldView = null, prefix = '',
  reload = false, started = false, sent = false, keepFocus = false,
}) {
  const req = {
    id, conversationId, view, content, files, userEl, oldView, prefix, reload, started, sent, keepFocus,
    text: '', reasoning: '', nextIndex: 0, pending: new Map(), done: false, resuming: false, cancelRequested: false,
  };
  requests.set(id, req);
  return req;
}

export const get = (id) => requests.get(id);
export const all = () => [...requests.values()];

/** The unfinished requests of one conversation (null: the new chat not started yet). */
export const activeIn = (conversationId) => all().filter((r) => r.conversationId === conversationId);

/** Stop tracking a request: it finished, failed or was refused. */
export function finish(req) {
  req.done = true;
  requests.delete(req.id);
  if (storage.get(KEY_INFLIGHT, null)?.id === req.id) storage.remove(KEY_INFLIGHT);
}

/** Add the delta at ``index``; true when the text grew (deltas may arrive out of order after a resume). */
export function addDelta(req, index, text, reasoning = '') {
  if (index < req.nextIndex) return false;
  if (index > req.nextIndex) {
    req.pending.set(index, [text, reasoning]);
    return false;
  }
  req.text += text;
  req.reasoning += reasoning;
  req.nextIndex += 1;
  while (req.pending.has(req.nextIndex)) {
    const [more, thought] = req.pending.get(req.nextIndex);
    req.text += more;
    req.reasoning += thought;
    req.pending.delete(req.nextIndex);
    req.nextIndex += 1;
  }
  return true;
}

/** Remember a started request, so a reload can pick its stream up. */
export function remember(req) {
  storage.set(KEY_INFLIGHT, { id: req.id, conversationId: req.conversationId, prefixChars: req.prefix.length });
}

/** How long the continued answer's text was before the remembered request (0: not a continue). */
export const rememberedPrefix = (conversationId) => {
  const inflight = storage.get(KEY_INFLIGHT, null);
  return inflight?.conversationId === conversationId && Number.isInteger(inflight.prefixChars) ? inflight.prefixChars : 0;
};

/** The request id streaming in ``conversationId`` when the page was left, or null. */
export function remembered(conversationId) {
  const inflight = storage.get(KEY_INFLIGHT, null);
  if (!inflight || inflight.conversationId !== conversationId || typeof inflight.id !== 'string') return null;
  return inflight.id;
}

// Word between this person's tabs: an answer started or ended in a conversation, so a tab
// showing that conversation follows the answer live and every tab's list stays current.

const channel = typeof BroadcastChannel === 'function' ? new BroadcastChannel('chat.tabs') : null;

/** Tell the other tabs that conversation ``conversationId`` changed ('started', 'ended', 'deleted'). */
export function tell(kind, conversationId) {
  try { channel?.postMessage({ kind, conversationId }); } catch { /* closing */ }
}

/** Call ``handler({kind, conversationId})`` for what other tabs tell. */
export function listen(handler) {
  channel?.addEventListener('message', (e) => {
    if (e.data && typeof e.data.conversationId === 'string') handler(e.data);
  });
}

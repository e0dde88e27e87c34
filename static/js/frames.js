// What the server's frames do to the page: a request's answer streaming in, settling,
// failing or rolled back; resuming after a reconnect. chat.js sends; this module receives.
import * as attachments from './attachments.js';
import * as chat from './chat.js';
import * as composer from './composer.js';
import * as models from './models.js';
import * as requests from './requests.js';
import * as router from './router.js';
import * as settings from './settings.js';
import * as sidebar from './sidebar.js';
import * as socket from './socket.js';
import * as tabs from './tabs.js';
import * as thinking from './thinking.js';
import * as thread from './thread.js';
import * as tokens from './tokens.js';
import { REASONS, setContextTokens, wholeAnswer } from './message.js';
import { announce } from './util.js';

/** Undo the optimistic page of a request the server refused (no start, no done). */
function rollback(req) {
  requests.finish(req);
  sidebar.render();
  if (req.reload) {
    if (req.conversationId === sidebar.currentId()) chat.openConversation(req.conversationId, { keepError: true });
  } else if (req.oldView) {
    if (req.view.el.isConnected) req.view.el.replaceWith(req.oldView);
    req.oldView.view.setRegenerating(null);
  } else {
    req.view.el.remove();
    req.userEl?.remove();
    composer.restore(req.content);
    attachments.restore(req.files);
  }
  thread.showEmptyIfNone();
}

/** A regenerated answer takes the old one's place once it has something to show. */
function swapIn(req) {
  if (!req.oldView || req.view.el.isConnected || !req.oldView.isConnected) return;
  const hadFocus = req.oldView.contains(document.activeElement);
  req.oldView.replaceWith(req.view.el);
  req.oldView.view.setRegenerating(null);
  if (hadFocus) {
    req.view.el.tabIndex = -1;
    req.view.el.focus({ preventScroll: true });
  }
}

/** A regenerated answer that ended: the keyboard, kept on the answer meanwhile, goes to its Regenerate. */
function refocus(req) {
  const active = document.activeElement;
  if (!req.keepFocus || !(active === document.body || req.view.el.contains(active))) return;
  const button = req.view.el.querySelector('[data-action="regenerate"]:not([hidden])');
  if (button) button.focus({ preventScroll: true });
}

/** End a started request with the text that has arrived, drawn final. */
function settle(req) {
  clearTimeout(req.liveTimer); // a Continue may write into the same answer next
  requests.finish(req);
  sidebar.render(); // its "answering" mark goes
  swapIn(req);
  thread.cancelRender(req.view);
  req.view.setText(req.prefix + req.text, true);
  if (req.reasoning) req.view.setReasoning(req.reasoning, false);
}

/** What the server said about itself (`ready`; then /readyz while the model loads: ``waiting``
 * 'loading' or 'failed', undefined once it is ready). */
export function showServer(waiting) {
  settings.showServer(socket.model(), socket.limits(), waiting);
  setContextTokens(socket.limits().context_tokens);
  models.setModels(socket.models(), socket.model());
  models.showFor(chat.shownRecord());
  thinking.setOffered(socket.thinks());
  thinking.showFor(chat.shownRecord());
}

function onReady() {
  showServer();
  composer.clearConnectionError();
  chat.retryLoad();
  for (const req of requests.all()) {
    if (req.sent) {
      req.resuming = true;
      socket.send({ type: 'resume', id: req.id, from: req.nextIndex });
      if (req.cancelRequested) socket.send({ type: 'cancel', id: req.id });
    } else if (!req.started) {
      rollback(req); // never reached the server: its text is back in the box, and goes now
      if (!req.reload && !req.oldView && composer.content().trim()) composer.setQueued(true, 'connection');
    }
  }
  chat.refreshControls();
  chat.sendQueued();
  sidebar.refresh();
}

/** The server is restarting: Send keeps messages until it is back; answers running now may finish. */
function onDraining() {
  chat.refreshControls();
}

function onQueued(msg) {
  const req = requests.get(msg.id);
  if (!req || req.started) return;
  req.view.setThinking(msg.position > 1 ? `Waiting in line · position ${msg.position}` : 'Waiting in line · next up');
}

function onStart(msg) {
  const req = requests.get(msg.id);
  if (!req) return;
  req.started = true;
  req.resuming = false;
  if (req.text === '') req.view.setThinking();
  if (!req.conversationId) {
    const viewingIt = sidebar.currentId() === null;
    req.conversationId = msg.conversation_id;
    sidebar.added(msg.conversation_id, req.content);
    if (viewingIt) {
      sidebar.setCurrent(msg.conversation_id);
      router.show(msg.conversation_id, { replace: true }); // the new chat's address becomes its own
    }
    sidebar.render();
  }
  requests.remember(req);
  tabs.tell('started', req.conversationId);
  sidebar.render(); // the chat shows as answering
  announce('The assistant is answering.');
  sidebar.refreshSoon();
}

const LIVE_EVERY_MS = 250;

function onDelta(msg) {
  const req = requests.get(msg.id);
  if (!req || !requests.addDelta(req, msg.index, msg.text, typeof msg.reasoning === 'string' ? msg.reasoning : '')) return;
  if (Number.isInteger(msg.tokens)) req.tokens = msg.tokens; // the engine's count, where it gives one
  // A thinking model's thinking: its own block, open while it thinks, closed once the answer begins.
  if (req.reasoning) req.view.setReasoning(req.reasoning, !(req.prefix + req.text));
  tokens.add(req.view, msg.logprobs);
  swapIn(req);
  thread.scheduleRender(req.view, req.prefix + req.text);
  // Live figures from the first delta this page saw (a resumed answer: counted from there), drawn at
  // most every LIVE_EVERY_MS, and once more after the last delta so the figure ends on the latest count.
  const now = performance.now();
  if (req.liveFrom === undefined) req.liveFrom = { at: now, count: req.tokens || req.nextIndex };
  clearTimeout(req.liveTimer);
  if (!(now - (req.liveAt || 0) < LIVE_EVERY_MS)) drawLive(req);
  else req.liveTimer = setTimeout(() => drawLive(req), LIVE_EVERY_MS);
}

/** The live line: the answer's tokens so far (the engine's own count when it gives one, so the figure
 * ends where `done` says; else one a delta) and tokens per second. */
function drawLive(req) {
  if (req.view.el.dataset.state === 'done' || requests.get(req.id) !== req) return;
  const now = performance.now();
  req.liveAt = now;
  const count = req.tokens || req.nextIndex;
  const seconds = (now - req.liveFrom.at) / 1000;
  const gained = count - req.liveFrom.count;
  const earlier = (req.prefix && req.view.done?.usage?.completion_tokens) || 0; // a continue: the whole answer
  req.view.showLive(earlier + count, seconds > 0.2 && gained > 0 ? gained / seconds : 0);
}

function onDone(msg) {
  const req = requests.get(msg.id);
  if (!req) return;
  const before = req.prefix ? req.view.done : null; // a continue: the figures it had
  settle(req);
  if (req.conversationId) tabs.tell('ended', req.conversationId);
  req.view.finish(before ? wholeAnswer(before, msg) : msg);
  if (!req.prefix && !req.text && msg.reason === 'stop') req.view.body.textContent = '(empty answer)';
  thread.followStream();
  chat.refreshControls();
  refocus(req);
  if (req.conversationId === sidebar.currentId()) {
    const reason = REASONS[msg.reason] ? ` (${REASONS[msg.reason]})` : '';
    announce(`Answer${reason}: ${req.text.slice(0, 2000)}`);
    chat.syncIds(); // the new messages' ids and versions, for Edit and the version switcher
    chat.sendQueued();
  }
  sidebar.refreshSoon();
}

function onError(msg) {
  const req = msg.id ? requests.get(msg.id) : null;
  const text = composer.errorText(msg.code, msg.message);
  if (!req) {
    composer.showError(text);
  } else if (req.resuming && msg.code === 'unknown_id') {
    // The server no longer has this answer: take what it stored.
    requests.finish(req);
    if (!req.started) {
      // Never accepted: give the text back so nothing typed is lost.
      rollback(req);
      composer.showError('The connection dropped before your message was accepted. Please send it again.');
    }
    if (req.conversationId && req.conversationId === sidebar.currentId()) {
      chat.openConversation(req.conversationId, { keepError: true });
    }
  } else if (!req.started) {
    rollback(req);
    if (msg.code === 'overloaded' && socket.isRestarting() && !req.reload && !req.oldView) {
      // Sent as the server began to drain: kept, and sent once it is back.
      composer.setQueued(true, 'restart');
      announce('The server is restarting. Your message will be sent once it is back.');
    } else {
      composer.showError(text);
    }
    if (msg.code === 'not_found' && req.conversationId === sidebar.currentId()) chat.forgetConversation(req.conversationId);
    // Answering in another tab: show that answer here, live.
    if (msg.code === 'busy' && req.conversationId === sidebar.currentId()) chat.syncIds();
  } else {
    settle(req);
    req.view.fail(text);
  }
  chat.refreshControls();
  if (req && req.conversationId === sidebar.currentId()) chat.sendQueued();
}

/** The model titled a new conversation after its first answer. */
function onTitle(msg) {
  if (typeof msg.conversation_id === 'string' && typeof msg.title === 'string' && msg.title.trim()) {
    sidebar.retitle(msg.conversation_id, msg.title);
  }
}

const HANDLERS = { ready: onReady, draining: onDraining, title: onTitle, queued: onQueued, start: onStart, delta: onDelta, done: onDone, error: onError };

/** Route one server frame to its handler; unknown types are ignored. */
export function onFrame(msg) {
  HANDLERS[msg?.type]?.(msg);
}

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
  req.oldView.replaceWith(req.view.el);
  req.oldView.view.setRegenerating(null);
}

/** End a started request with the text that has arrived, drawn final. */
function settle(req) {
  requests.finish(req);
  sidebar.render(); // its "answering" mark goes
  swapIn(req);
  thread.cancelRender(req.view);
  req.view.setText(req.prefix + req.text, true);
}

/** What the server said about itself (`ready`; then /readyz while the model loads: ``waiting``
 * 'loading' or 'failed', undefined once it is ready). */
export function showServer(waiting) {
  settings.showServer(socket.model(), socket.limits(), waiting);
  setContextTokens(socket.limits().context_tokens);
  models.setModels(socket.models(), socket.model());
  models.showFor(chat.shownRecord());
}

function onReady() {
  showServer();
  chat.retryLoad();
  for (const req of requests.all()) {
    if (req.sent) {
      req.resuming = true;
      socket.send({ type: 'resume', id: req.id, from: req.nextIndex });
      if (req.cancelRequested) socket.send({ type: 'cancel', id: req.id });
    } else if (!req.started) {
      rollback(req);
    }
  }
  chat.refreshControls();
  sidebar.refresh();
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
  if (!req || !requests.addDelta(req, msg.index, msg.text)) return;
  tokens.add(req.view, msg.logprobs);
  swapIn(req);
  thread.scheduleRender(req.view, req.prefix + req.text);
  // Live figures from the first delta this page saw (a resumed answer: counted from there).
  const now = performance.now();
  if (req.liveFrom === undefined) req.liveFrom = { at: now, index: msg.index };
  if (!(now - (req.liveAt || 0) < LIVE_EVERY_MS)) {
    req.liveAt = now;
    const seconds = (now - req.liveFrom.at) / 1000;
    const gaps = req.nextIndex - 1 - req.liveFrom.index; // deltas after the first one timed
    const earlier = (req.prefix && req.view.done?.usage?.completion_tokens) || 0; // a continue: the whole answer
    req.view.showLive(earlier + req.nextIndex, seconds > 0.2 && gaps > 0 ? gaps / seconds : 0);
  }
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
    composer.showError(text);
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

const HANDLERS = { ready: onReady, queued: onQueued, start: onStart, delta: onDelta, done: onDone, error: onError };

/** Route one server frame to its handler; unknown types are ignored. */
export function onFrame(msg) {
  HANDLERS[msg?.type]?.(msg);
}

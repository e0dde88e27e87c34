// What a person does with a conversation (open, send, regenerate, stop, delete) and how
// chat.v1 frames from the server move the page along.
import * as api from './api.js';
import * as composer from './composer.js';
import * as requests from './requests.js';
import * as settings from './settings.js';
import * as sidebar from './sidebar.js';
import * as socket from './socket.js';
import * as thread from './thread.js';
import { AssistantMessage, REASONS } from './message.js';
import { announce, newId } from './util.js';

let viewToken = 0; // the latest openConversation; older loads arriving late are dropped

const inView = () => requests.activeIn(sidebar.currentId());

/** Bring Send/Stop and Regenerate in line with the connection and the open conversation. */
export function refreshControls() {
  const busy = inView().length > 0;
  composer.update(busy);
  thread.updateRegenerate(busy || !sidebar.currentId());
}

// ---------------------------------------------------------------- what the person does

/** Send the composer's text as a chat message. */
export function send() {
  const content = composer.content();
  if (!content.trim() || inView().length) return;
  if (!socket.isReady()) {
    composer.showError('Not connected to the server yet. Your message is kept; send it once the connection is back.');
    return;
  }
  if (composer.tooLong(content)) {
    composer.showError(composer.errorText('too_large'));
    return;
  }
  composer.clearError();
  composer.clear();
  const conversationId = sidebar.currentId();
  const message = { type: 'chat', id: newId(), content };
  if (conversationId) message.conversation_id = conversationId;
  else if (settings.systemPrompt()) message.system = settings.systemPrompt();
  submit(message, { conversationId, content, userEl: thread.appendUser(content) });
}

/** Answer the last user message again, replacing the last answer. */
export function regenerate() {
  const conversationId = sidebar.currentId();
  const last = thread.lastMessage();
  if (!socket.isReady() || !conversationId || inView().length || !last?.classList.contains('msg-assistant')) return;
  composer.clearError();
  submit({ type: 'regenerate', id: newId(), conversation_id: conversationId }, { conversationId, oldView: last });
}

/** Show a waiting answer, track the request and send it (or leave it for the next `ready`). */
function submit(message, record) {
  const params = settings.params(socket.limits());
  if (params) message.params = params;
  const view = new AssistantMessage();
  view.setThinking();
  if (record.oldView) record.oldView.replaceWith(view.el);
  else thread.append(view.el);
  const req = requests.add({ ...record, id: message.id, view });
  req.sent = socket.send(message);
  thread.followLatest();
  refreshControls();
}

/** Cancel the answers streaming into the open conversation; false when there are none. */
export function stop() {
  const active = inView();
  for (const req of active) {
    req.cancelRequested = true;
    socket.send({ type: 'cancel', id: req.id });
  }
  return active.length > 0;
}

/** Show conversation ``id`` (null: a new chat) as the server has stored it. */
export async function openConversation(id, { keepError = false } = {}) {
  const token = ++viewToken;
  if (!keepError) composer.clearError();
  sidebar.setCurrent(id);
  thread.reset(!id);
  refreshControls();
  if (!id) return;
  let conversation;
  try {
    conversation = await api.getConversation(id);
  } catch (err) {
    if (token !== viewToken) return;
    if (err.status === 404) forgetConversation(id);
    else composer.showError(`Could not load this conversation: ${err.message}`);
    return;
  }
  if (token !== viewToken) return;
  thread.showStored(conversation.messages, inView());
  if (conversation.title) sidebar.setTitle(conversation.id, conversation.title);
  refreshControls();
}

function forgetConversation(id) {
  const wasOpen = sidebar.currentId() === id;
  sidebar.forget(id);
  if (wasOpen) openConversation(null);
}

/** Delete a conversation after asking, cancelling its answers first. */
export async function deleteConversation(id) {
  if (!confirm(`Delete “${sidebar.titleOf(id)}”? This cannot be undone.`)) return;
  for (const req of requests.activeIn(id)) socket.send({ type: 'cancel', id: req.id });
  try {
    await api.deleteConversation(id);
  } catch (err) {
    if (err.status !== 404) {
      composer.showError(`Could not delete: ${err.message}`);
      return;
    }
  }
  forgetConversation(id);
  announce('Conversation deleted.');
}

/** After a reload during an answer: track it again, to resume once connected (the server keeps it a while). */
export function adoptInflight(conversationId) {
  const id = requests.remembered(conversationId);
  if (!id) return;
  const view = new AssistantMessage();
  view.setThinking();
  requests.add({ id, conversationId, view, started: true, sent: true });
}

// ---------------------------------------------------------------- frames from the server

/** Undo the optimistic page of a request the server refused (no start, no done). */
function rollback(req) {
  requests.finish(req);
  if (req.oldView) {
    req.view.el.replaceWith(req.oldView);
  } else {
    req.view.el.remove();
    req.userEl?.remove();
    composer.restore(req.content);
  }
  thread.showEmptyIfNone();
}

/** End a started request with the text that has arrived, drawn final. */
function settle(req) {
  requests.finish(req);
  thread.cancelRender(req.view);
  req.view.setText(req.text, true);
}

function onReady() {
  settings.showServer(socket.model(), socket.limits());
  for (const req of requests.all()) {
    if (req.sent) {
      req.resuming = true;
      socket.send({ type: 'resume', id: req.id, from: req.nextIndex });
      if (req.cancelRequested) socket.send({ type: 'cancel', id: req.id });
    } else if (!req.started) {
      rollback(req);
    }
  }
  refreshControls();
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
    if (viewingIt) sidebar.setCurrent(msg.conversation_id);
    sidebar.render();
  }
  requests.remember(req);
  announce('The assistant is answering.');
  sidebar.refreshSoon();
}

function onDelta(msg) {
  const req = requests.get(msg.id);
  if (req && requests.addDelta(req, msg.index, msg.text)) thread.scheduleRender(req.view, req.text);
}

function onDone(msg) {
  const req = requests.get(msg.id);
  if (!req) return;
  settle(req);
  req.view.finish(msg);
  if (!req.text && msg.reason === 'stop') req.view.body.textContent = '(empty answer)';
  thread.followStream();
  refreshControls();
  if (req.conversationId === sidebar.currentId()) {
    const reason = REASONS[msg.reason] ? ` (${REASONS[msg.reason]})` : '';
    announce(`Answer${reason}: ${req.text.slice(0, 2000)}`);
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
      openConversation(req.conversationId, { keepError: true });
    }
  } else if (!req.started) {
    rollback(req);
    composer.showError(text);
    if (msg.code === 'not_found' && req.conversationId === sidebar.currentId()) forgetConversation(req.conversationId);
  } else {
    settle(req);
    req.view.fail(text);
  }
  refreshControls();
}

const HANDLERS = { ready: onReady, queued: onQueued, start: onStart, delta: onDelta, done: onDone, error: onError };

/** Route one server frame to its handler; unknown types are ignored. */
export function onFrame(msg) {
  HANDLERS[msg?.type]?.(msg);
}

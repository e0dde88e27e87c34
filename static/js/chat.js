// What a person does with a conversation (open, send, edit, regenerate, continue, switch
// versions, stop, delete); frames.js applies what the server sends back.
import * as api from './api.js';
import * as attachments from './attachments.js';
import * as composer from './composer.js';
import { els } from './dom.js';
import * as models from './models.js';
import * as thinking from './thinking.js';
import * as requests from './requests.js';
import * as router from './router.js';
import * as settings from './settings.js';
import * as sidebar from './sidebar.js';
import * as socket from './socket.js';
import * as thread from './thread.js';
import * as tokens from './tokens.js';
import { AssistantMessage, editInPlace, setUserText } from './message.js';
import { announce, newId } from './util.js';

let viewToken = 0; // the latest openConversation; older loads arriving late are dropped
let shown = null; // the open conversation's record as the server sent it (title, system, params, model)
let unloaded = null; // the open conversation's id while its load failed (it loads again on the next `ready`)
let retryTimer = 0;

const inView = () => requests.activeIn(sidebar.currentId());

/** The open conversation's record as the server last sent it (null for a new chat). */
export const shownRecord = () => shown;

/** Bring Send/Stop and Regenerate in line with the connection and the open conversation. */
export function refreshControls() {
  const busy = inView().length > 0;
  composer.update(busy);
  thread.updateRegenerate(busy || !sidebar.currentId());
}

// ---------------------------------------------------------------- what the person does

/** Send the composer's text as a chat message; while an answer is being written, it is kept and
 * sent when that answer ends. */
export function send() {
  const content = composer.content();
  if (!content.trim()) return;
  if (unloaded && unloaded === sidebar.currentId()) {
    // Never add to a history the person cannot see: it goes once the conversation shows.
    hold('load', 'Your message will be sent once this conversation has loaded.');
    return;
  }
  if (inView().length) {
    hold('answer', 'Your message will be sent when this answer finishes.');
    return;
  }
  if (!socket.isReady()) {
    if (socket.isRestarting()) hold('restart', 'The server is restarting. Your message will be sent once it is back.');
    else hold('connection', 'Your message will be sent when the connection is back.');
    return;
  }
  composer.setQueued(false);
  const busy = attachments.reading();
  if (busy) {
    composer.showError(`“${busy}” is still being read. Send once its chip shows its tokens.`);
    return;
  }
  const files = attachments.current();
  if (composer.tooLong(content + files.map((f) => f.text).join(''))) {
    composer.showError(composer.errorText('too_large'));
    return;
  }
  composer.clearError();
  composer.clear();
  attachments.clear();
  attachments.countDraft();
  const conversationId = sidebar.currentId();
  const message = { type: 'chat', id: newId(), content };
  if (files.length) message.attachments = files;
  if (conversationId) {
    message.conversation_id = conversationId;
  } else {
    if (settings.systemPrompt()) message.system = settings.systemPrompt();
    if (models.several()) message.model = models.forNewChat();
  }
  submit(message, { conversationId, content, files, userEl: thread.appendUser(content, files) });
}

/** Keep the box's text, to be sent when ``why`` ('answer', 'connection', 'restart', 'load') is over. */
function hold(why, said) {
  const again = composer.isQueued();
  composer.setQueued(true, why);
  if (why !== 'answer') composer.clearError();
  if (!again) announce(said);
  refreshControls();
}

/** After an answer ends, the connection is back or the conversation loaded: a message kept for it
 * goes out now. */
export function sendQueued() {
  if (!composer.isQueued() || inView().length) return;
  if (!composer.content().trim()) {
    composer.setQueued(false);
    return;
  }
  send();
}

/** Keep the typed text, but do not send it when the answer ends. */
export function cancelQueued() {
  composer.setQueued(false);
  refreshControls();
}

/** Whether a new request may start in the open conversation; says why not when it may not. */
function canStart() {
  if (!sidebar.currentId() || inView().length) return false;
  if (!socket.isReady()) {
    composer.showError(socket.isRestarting() ? 'The server is restarting. Try again once it is back.'
      : 'Not connected to the server yet. Try again once the connection is back.', { connection: true });
    return false;
  }
  composer.clearError();
  return true;
}

/** Edit a user message in place; Enter sends it as a new version, whose answer follows. */
export function edit(article) {
  if (inView().length) return;
  editInPlace(article, async (content) => {
    els.prompt.focus({ preventScroll: true }); // the edit box is gone: the keyboard goes on from the composer
    if (!canStart()) return;
    if (composer.tooLong(content + (article.files || []).map((f) => f.text).join(''))) {
      composer.showError(composer.errorText('too_large'));
      return;
    }
    const conversationId = sidebar.currentId();
    if (!article.dataset.id && !(await syncIds())) return;
    setUserText(article, content);
    // What followed the old version stays on its branch; the page shows the new one.
    const after = thread.messageEls();
    for (const el of after.slice(after.indexOf(article) + 1)) el.remove();
    submit({ type: 'edit', id: newId(), conversation_id: conversationId, message_id: article.dataset.id, content },
      { conversationId, reload: true });
  });
}

/** Extend an answer that was cut short; the new text streams onto its end. */
export function continueAnswer(view) {
  if (!canStart() || view.el !== thread.lastMessage()) return;
  const conversationId = sidebar.currentId();
  const hadFocus = view.el.contains(document.activeElement);
  view.resume();
  if (hadFocus) els.prompt.focus({ preventScroll: true }); // its Continue button is gone while it writes
  const message = { type: 'continue', id: newId(), conversation_id: conversationId };
  submit(message, { conversationId, view, prefix: view.text, reload: true });
}

/** Show the previous (-1) or next (+1) version of a message, and the path below it. */
export async function switchVersion(el, step) {
  const conversationId = sidebar.currentId();
  const ids = el.versions?.ids || [];
  const target = ids[el.versions.index + step];
  if (!conversationId || !target || inView().length) return;
  let conversation;
  try {
    conversation = await api.setActive(conversationId, target);
  } catch (err) {
    composer.showError(`Could not switch versions: ${err.message}`);
    return;
  }
  if (sidebar.currentId() !== conversationId) return;
  const index = thread.messageEls().indexOf(el);
  const hadFocus = el.contains(document.activeElement);
  thread.replaceFrom(el, conversation.messages.slice(index));
  refreshControls();
  if (hadFocus) {
    // The message was drawn again: keep the keyboard on its switcher (the other arrow at an end).
    const again = thread.messageEls()[index];
    const same = again?.querySelector(`[data-action="version-${step < 0 ? 'prev' : 'next'}"]`);
    (same && !same.disabled ? same : again?.querySelector('[data-action^="version-"]:not(:disabled)'))?.focus();
  }
  announce(`Version ${el.versions.index + step + 1} of ${ids.length}`);
}

/** Fetch the open conversation's ids and versions onto the messages shown (or redraw it). */
export async function syncIds() {
  const id = sidebar.currentId();
  if (!id) return false;
  let conversation;
  try { conversation = await api.getConversation(id); } catch { return false; }
  if (sidebar.currentId() !== id || inView().length) return false;
  if (conversation.answering && !requests.get(conversation.answering.id)) {
    openConversation(id, { address: false, keepError: true }); // another tab's answer: show it live
    return false;
  }
  if (!thread.applyIds(conversation.messages)) thread.showStored(conversation.messages, []);
  showRecord(conversation);
  refreshControls();
  return true;
}

/** The open conversation's record: its title (an edited first message renames it), its own
 * settings in the line above the thread, its model in the picker. */
function showRecord(conversation) {
  const { messages, ...record } = conversation;
  shown = record;
  sidebar.setEntry(record);
  const line = settings.summary(record);
  els.chatInfo.hidden = !line;
  els.chatInfo.textContent = line;
  els.chatInfo.title = line ? 'This chat’s own settings: click to change them' : '';
  models.showFor(record);
  thinking.showFor(record);
}

/** Copy the open conversation, as its Markdown export, to the clipboard. */
export async function copyAsMarkdown() {
  const id = sidebar.currentId();
  if (!id) return;
  try {
    const res = await fetch(api.exportUrl(id, 'md'), { credentials: 'same-origin' });
    if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
    await thread.copyText(await res.text());
    announce('The conversation is copied as Markdown.');
  } catch (err) {
    composer.showError(`Could not copy: ${err.message}`);
  }
}

/** Open the settings dialog on the open conversation's own settings. */
export async function openChatSettings() {
  const id = sidebar.currentId();
  if (!id) return;
  if (shown?.id !== id) {
    try { showRecord(await api.getConversation(id)); } catch (err) {
      composer.showError(`Could not load this chat’s settings: ${err.message}`);
      return;
    }
  }
  settings.open(shown, async (changes) => {
    const record = await api.updateConversation(id, changes);
    if (sidebar.currentId() === id) showRecord(record);
  });
}

/** The model picker changed: the open conversation's model, or the next new chat's. */
export async function pickModel(model) {
  const id = sidebar.currentId();
  if (!id) {
    models.rememberForNewChat(model);
    return;
  }
  try {
    const record = await api.updateConversation(id, { model });
    if (sidebar.currentId() === id) showRecord(record);
    announce(`This chat now uses ${model}.`);
  } catch (err) {
    composer.showError(`Could not switch the model: ${err.message}`);
    models.showFor(shown);
  }
}

/** The thinking switch was pressed: a new chat's (kept in the browser), or the open conversation's own setting. */
export async function toggleThinking() {
  const id = sidebar.currentId();
  const on = !thinking.isOn(id ? shown : null);
  if (!id) {
    thinking.rememberForNewChat(on);
    thinking.showFor(null);
    announce(on ? 'New chats think before they answer.' : 'New chats answer without thinking.');
    return;
  }
  try {
    const params = { ...(shown?.params || settings.params(socket.limits()) || {}), enable_thinking: on };
    const record = await api.updateConversation(id, { params });
    if (sidebar.currentId() === id) showRecord(record);
    announce(on ? 'This chat thinks before it answers.' : 'This chat answers without thinking.');
  } catch (err) {
    composer.showError(`Could not switch thinking: ${err.message}`);
    thinking.showFor(shown);
  }
}

/** Answer the last user message again: a new version beside the last answer. The old answer
 * stays in view until the new one's first words arrive; the new version's number shows at once. */
export function regenerate() {
  const conversationId = sidebar.currentId();
  const last = thread.lastMessage();
  if (!socket.isReady() || !conversationId || inView().length || !last?.classList.contains('msg-assistant')) return;
  composer.clearError();
  const view = new AssistantMessage();
  const count = (last.versions?.count || 1) + 1;
  view.showPendingVersion(count - 1, count);
  view.setThinking();
  last.view.setRegenerating(`Writing version ${count} of ${count}…`);
  // The keyboard stays with the answer: on it while the new version is written (its buttons hide),
  // then on the new version's Regenerate (frames.js).
  const keepFocus = last.contains(document.activeElement);
  if (keepFocus) {
    last.tabIndex = -1;
    last.focus({ preventScroll: true });
  }
  submit({ type: 'regenerate', id: newId(), conversation_id: conversationId },
    { conversationId, oldView: last, view, keepFocus });
}

/** The `params` a turn sends: none for a conversation with settings of its own (the server keeps
 * them), else the defaults from Settings. */
function turnParams(conversationId) {
  const own = conversationId && shown?.id === conversationId && Object.keys(shown.params || {}).length;
  return own ? null : thinking.withSwitch(settings.params(socket.limits()), conversationId ? shown : null);
}

/** Show a waiting answer, track the request and send it (or leave it for the next `ready`). */
function submit(message, record) {
  const params = tokens.withLogprobs(turnParams(record.conversationId));
  if (params) message.params = params;
  let view = record.view;
  if (!view) {
    view = new AssistantMessage();
    view.setThinking();
    thread.append(view.el);
  }
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

/** Show conversation ``id`` (null: a new chat) as the server has stored it; with ``reveal``,
 * scroll to that message, first switching to its branch when it is on another. ``address``:
 * 'push' a history entry for it, 'replace' the current one, or leave the address (Back/Forward). */
export async function openConversation(id, { keepError = false, reveal = null, address = 'push' } = {}) {
  const token = ++viewToken;
  const retrying = unloaded !== null && unloaded === id;
  unloaded = null;
  clearTimeout(retryTimer);
  if (!keepError) composer.clearError();
  if (id !== sidebar.currentId()) cancelQueued();
  if (address) router.show(id, { replace: address === 'replace' });
  sidebar.setCurrent(id);
  thread.reset(!id);
  shown = null;
  els.chatInfo.hidden = true;
  models.showFor(null);
  thinking.showFor(null);
  refreshControls();
  if (!id) return;
  let conversation;
  try {
    conversation = await api.getConversation(id);
  } catch (err) {
    if (token !== viewToken) return;
    // Not this client's (or gone): a new chat, with a line that never says whether it exists.
    if (err.status === 404) {
      forgetConversation(id);
      composer.showError('That conversation was not found: it may have been deleted. This is a new chat.');
    } else {
      unloaded = id;
      composer.showError(`Could not load this conversation (${err.message}). It loads again by itself once the server answers.`);
      // Connected all along (the socket will not say `ready` again): try again in a moment.
      if (socket.isReady()) retryTimer = setTimeout(retryLoad, 3000);
    }
    return;
  }
  if (token !== viewToken) return;
  if (retrying) composer.clearError();
  follow(conversation);
  const live = inView();
  for (const req of live) {
    // A continue adopted after a reload: its text so far is the stored answer's beginning.
    const last = conversation.messages[conversation.messages.length - 1];
    if (req.prefixChars && !req.prefix && last?.role === 'assistant') req.prefix = last.content.slice(0, req.prefixChars);
  }
  if (reveal && !conversation.messages.some((m) => m.id === reveal) && !live.length) {
    try { conversation = await api.setActive(id, reveal); } catch { /* show the active path */ }
    if (token !== viewToken) return;
  }
  thread.showStored(conversation.messages, live);
  if (reveal) requestAnimationFrame(() => thread.reveal(reveal));
  showRecord(conversation);
  refreshControls();
  if (retrying) sendQueued(); // a message kept while it could not load
}

export function forgetConversation(id) {
  const wasOpen = sidebar.currentId() === id;
  sidebar.forget(id);
  if (wasOpen) openConversation(null, { address: 'replace' });
}

/** Edit an answer in place; Save (or Ctrl+Enter) keeps the text as a new version of it ("Edited by you"),
 * which the model sees from then on; the old version stays a click away. */
export function editAnswer(article) {
  if (inView().length || !article.view) return;
  article.content = article.view.text;
  editInPlace(article, async (content) => {
    const conversationId = sidebar.currentId();
    if (!article.dataset.id && !(await syncIds())) return;
    try {
      const conversation = await api.editAnswer(conversationId, article.dataset.id, content);
      if (sidebar.currentId() !== conversationId) return;
      thread.showStored(conversation.messages, []);
      showRecord(conversation);
      refreshControls();
      announce('Your edit is saved as a new version of the answer.');
      thread.lastMessage()?.querySelector('[data-action="edit-answer"]')?.focus({ preventScroll: true });
    } catch (err) {
      composer.showError(`Could not save the edit: ${err.message}`);
    }
  }, { multiline: true, action: 'edit-answer' });
}

/** Branch into a new chat: the conversation down to message ``el`` (on the version shown) becomes a chat
 * of its own, opened at once; this one stays as it is. */
export async function branchFrom(el) {
  const conversationId = sidebar.currentId();
  if (!conversationId || inView().length) return;
  if (!el.dataset.id && !(await syncIds())) return;
  try {
    const { id } = await api.branch(conversationId, el.dataset.id);
    await sidebar.refresh();
    await openConversation(id);
    announce('Branched into a new chat.');
    els.prompt.focus({ preventScroll: true });
  } catch (err) {
    composer.showError(`Could not branch: ${err.message}`);
  }
}

/** Load the open conversation again when its last load failed (the socket is back). */
export function retryLoad() {
  if (unloaded && unloaded === sidebar.currentId()) openConversation(unloaded, { address: false });
}

/** An answer another tab (or this one before a reload) is writing in the conversation just
 * loaded: follow it here too, from its first delta. */
function follow(conversation) {
  const running = conversation.answering;
  if (!running?.id || requests.get(running.id)) return;
  const view = new AssistantMessage();
  view.setThinking();
  const req = requests.add({ id: running.id, conversationId: conversation.id, view, started: true, sent: true });
  req.prefixChars = running.prefix_chars || 0;
  req.resuming = true;
  socket.send({ type: 'resume', id: req.id, from: 0 }); // not connected: the next `ready` resumes it
}

/** After a reload during an answer: track it again, to resume once connected (the server keeps it a while). */
export function adoptInflight(conversationId) {
  const id = requests.remembered(conversationId);
  if (!id) return;
  const view = new AssistantMessage();
  view.setThinking();
  const req = requests.add({ id, conversationId, view, started: true, sent: true });
  req.prefixChars = requests.rememberedPrefix(conversationId);
}

// The chat.v1 WebSocket: one connection, reconnect with a short backoff (sooner when /healthz
// answers, Retry now), the status dot, what `ready` said (and /healthz, while the model loads),
// and `draining`: the server is restarting, said as such until a new `ready`.
import { els } from './dom.js';
import { announce } from './util.js';

let ws = null;
let ready = false;
let everReady = false;
let restarting = false; // the server said `draining`: true until the next `ready`
let attempt = 0;
let reconnectTimer = 0;
let countdownTimer = 0;
let probeTimer = 0;
let socketToken = 0; // which socket a readiness watch belongs to
let server = { model: '', models: [], limits: {} };
let listener = { frame() {}, closed() {}, changed() {} };

const MAX_WAIT_MS = 5000; // the longest wait between two tries
const PROBE_MS = 1500; // how often /healthz is asked while waiting
const PROBE_TIMEOUT_MS = 2500;
const READY_POLL_MS = 2000; // how often /healthz is asked while the model loads

/** True between `ready` and the socket closing (or the server saying it drains). */
export const isReady = () => ready;
/** True from the server's `draining` until the next `ready`: it is restarting, not busy. */
export const isRestarting = () => restarting;
/** The model's display name from `ready` ('' before the first). */
export const model = () => server.model;
/** Every model the server serves, its default first, from `ready` ([] before the first). */
export const models = () => server.models;
/** The server's limits from `ready` ({} before the first). */
export const limits = () => server.limits;
/** Whether the model thinks (`ready.thinking`): the page offers its switch. */
export const thinks = () => Boolean(server.thinking);

/** Send one frame; false when there is no open socket (the caller resumes after `ready`). */
export function send(message) {
  if (!ws || ws.readyState !== WebSocket.OPEN) return false;
  ws.send(JSON.stringify(message));
  return true;
}

/** Connect and keep reconnecting; ``frame(msg)`` gets every frame, ``closed()`` each drop,
 * ``server()`` each change of what the server said about itself (a model loaded after `ready`). */
export function start({ frame, closed, server: changed = () => {} }) {
  listener = { frame, closed, changed };
  els.connRetry.addEventListener('click', reconnectNow);
  connect();
}

/** Try at once instead of waiting out the backoff (Retry now, back online, tab visible again). */
export function reconnectNow() {
  if (!ws) connect();
}

function wsUrl() {
  const scheme = location.protocol === 'https:' ? 'wss:' : 'ws:';
  return `${scheme}//${location.host}/ws`;
}

function setConn(kind, text) {
  // Screen readers hear transitions only, not every tick of the retry countdown.
  if (everReady && kind !== els.conn.dataset.state) {
    if (kind === 'open') announce('Reconnected.');
    else if (kind === 'restarting' && els.conn.dataset.state === 'open') announce('The server is restarting. Reconnecting…');
    else if (kind === 'closed' && els.conn.dataset.state === 'open') announce('Connection lost. Reconnecting…');
  }
  els.conn.dataset.state = kind;
  els.connText.textContent = text;
  els.connRetry.hidden = kind !== 'closed' && !(kind === 'restarting' && !ws);
}

/** The server is stopping: answers running now may finish, new ones wait for the next `ready`. */
function onDraining() {
  restarting = true;
  ready = false;
  setConn('restarting', 'Server restarting…');
}

function onReady(msg) {
  attempt = 0;
  server = { model: msg.model || '', models: Array.isArray(msg.models) ? msg.models : [], limits: msg.limits || {},
    thinking: msg.thinking === true };
  everReady = true;
  if (msg.draining) { // a server that is stopping accepted this socket: still restarting
    onDraining();
    return;
  }
  ready = true;
  restarting = false;
  setConn('open', 'Connected');
  watchModel(socketToken);
}

/** While the model loads (or its backend is down), `ready` names a placeholder: ask /healthz (200
 * whatever the model does, so nothing fails in the console) until its `model` says ready, telling
 * ``changed('loading' | 'failed')``, then take the name it gives. */
async function watchModel(token) {
  let waiting = null;
  while (token === socketToken && ready) {
    let answer = null;
    try {
      const response = await fetch('/healthz', { cache: 'no-store' });
      answer = { ok: response.ok, body: await response.json() };
    } catch { return; } // unreachable: the socket's own drop says so
    if (token !== socketToken) return;
    if (!answer.ok) return;
    const status = answer.body?.model;
    if (status === 'ready') {
      const name = answer.body?.name;
      if (waiting && typeof name === 'string' && name && name !== server.model) {
        server.models = [name, ...server.models.filter((m) => m !== server.model && m !== name)];
        server.model = name;
      }
      if (waiting) server.thinking = answer.body?.thinking === true;
      if (waiting) listener.changed();
      return;
    }
    if (status !== 'loading' && status !== 'failed') return;
    if (status !== waiting) listener.changed(status);
    waiting = status;
    await new Promise((resolve) => { setTimeout(resolve, READY_POLL_MS); });
  }
}

function connect() {
  clearTimeout(reconnectTimer);
  clearInterval(countdownTimer);
  clearInterval(probeTimer);
  if (ws) return;
  if (restarting) setConn('restarting', 'Server restarting · reconnecting…');
  else setConn('connecting', everReady ? 'Reconnecting…' : 'Connecting…');
  let socket;
  try {
    socket = new WebSocket(wsUrl());
  } catch {
    scheduleReconnect();
    return;
  }
  ws = socket;
  socketToken += 1;
  socket.addEventListener('message', (event) => {
    if (socket !== ws || typeof event.data !== 'string') return;
    let msg;
    try { msg = JSON.parse(event.data); } catch { return; }
    if (msg?.type === 'ready') onReady(msg);
    else if (msg?.type === 'draining') onDraining();
    listener.frame(msg);
  });
  socket.addEventListener('close', () => {
    if (socket !== ws) return;
    ws = null;
    ready = false;
    listener.closed();
    scheduleReconnect();
  });
}

/** Whether the server answers /healthz now (within a couple of seconds). */
async function serverAnswers() {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), PROBE_TIMEOUT_MS);
  try {
    return (await fetch('/healthz', { cache: 'no-store', signal: abort.signal })).ok;
  } catch {
    return false;
  } finally {
    clearTimeout(timer);
  }
}

function scheduleReconnect() {
  // Backoff with jitter, so a restarted server is not stampeded, but capped low: while waiting,
  // /healthz is asked every PROBE_MS and the socket tries again the moment the server answers.
  const cap = Math.min(MAX_WAIT_MS, 400 * 2 ** Math.min(attempt, 10));
  const delay = Math.round(cap / 2 + Math.random() * cap / 2);
  attempt += 1;
  const at = Date.now() + delay;
  const tick = () => {
    if (navigator.onLine === false) {
      setConn('closed', 'Offline · reconnects when the network is back');
      return;
    }
    const left = Math.max(1, Math.ceil((at - Date.now()) / 1000));
    if (restarting) setConn('restarting', `Server restarting · retrying in ${left} s`);
    else setConn('closed', `Disconnected · retrying in ${left} s`);
  };
  tick();
  clearInterval(countdownTimer);
  countdownTimer = setInterval(tick, 250);
  clearTimeout(reconnectTimer);
  reconnectTimer = setTimeout(connect, delay);
  clearInterval(probeTimer);
  if (delay > PROBE_MS) {
    probeTimer = setInterval(async () => {
      if (!ws && await serverAnswers() && !ws) connect();
    }, PROBE_MS);
  }
}

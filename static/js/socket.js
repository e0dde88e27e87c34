// The chat.v1 WebSocket: one connection, reconnect with backoff, the status dot, and what `ready` said.
import { els } from './dom.js';
import { announce } from './util.js';

let ws = null;
let ready = false;
let everReady = false;
let attempt = 0;
let reconnectTimer = 0;
let countdownTimer = 0;
let server = { model: '', models: [], limits: {} };
let listener = { frame() {}, closed() {} };

/** True between `ready` and the socket closing. */
export const isReady = () => ready;
/** The model's display name from `ready` ('' before the first). */
export const model = () => server.model;
/** Every model the server serves, its default first, from `ready` ([] before the first). */
export const models = () => server.models;
/** The server's limits from `ready` ({} before the first). */
export const limits = () => server.limits;

/** Send one frame; false when there is no open socket (the caller resumes after `ready`). */
export function send(message) {
  if (!ws || ws.readyState !== WebSocket.OPEN) return false;
  ws.send(JSON.stringify(message));
  return true;
}

/** Connect and keep reconnecting; ``frame(msg)`` gets every frame, ``closed()`` each drop. */
export function start({ frame, closed }) {
  listener = { frame, closed };
  connect();
}

/** Try at once instead of waiting out the backoff (back online, tab visible again). */
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
    else if (kind === 'closed' && els.conn.dataset.state === 'open') announce('Connection lost. Reconnecting…');
  }
  els.conn.dataset.state = kind;
  els.connText.textContent = text;
}

function onReady(msg) {
  ready = true;
  attempt = 0;
  server = { model: msg.model || '', models: Array.isArray(msg.models) ? msg.models : [], limits: msg.limits || {} };
  setConn('open', 'Connected');
  everReady = true;
}

function connect() {
  clearTimeout(reconnectTimer);
  clearInterval(countdownTimer);
  if (ws) return;
  setConn('connecting', everReady ? 'Reconnecting…' : 'Connecting…');
  let socket;
  try {
    socket = new WebSocket(wsUrl());
  } catch {
    scheduleReconnect();
    return;
  }
  ws = socket;
  socket.addEventListener('message', (event) => {
    if (socket !== ws || typeof event.data !== 'string') return;
    let msg;
    try { msg = JSON.parse(event.data); } catch { return; }
    if (msg?.type === 'ready') onReady(msg);
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

function scheduleReconnect() {
  // Exponential backoff with jitter, so a restarted server is not stampeded.
  const cap = Math.min(30000, 500 * 2 ** Math.min(attempt, 10));
  const delay = Math.round(cap / 2 + Math.random() * cap / 2);
  attempt += 1;
  const at = Date.now() + delay;
  const tick = () => {
    const left = Math.max(0, Math.ceil((at - Date.now()) / 1000));
    setConn('closed', navigator.onLine === false ? 'Offline' : `Disconnected · retrying in ${left} s`);
  };
  tick();
  clearInterval(countdownTimer);
  countdownTimer = setInterval(tick, 1000);
  clearTimeout(reconnectTimer);
  reconnectTimer = setTimeout(connect, delay);
}

// Import: a conversation exported as JSON (or an OpenAI-style messages list) becomes a new one.
import * as api from './api.js';
import { showError, clearError } from './composer.js';

/** Import one file; returns the new conversation's id, or null after saying what went wrong. */
export async function importFile(file) {
  let body;
  try {
    body = JSON.parse(await file.text());
  } catch {
    showError(`“${file.name}” is not a JSON export, so it cannot be imported.`);
    return null;
  }
  try {
    const { id } = await api.importConversation(body);
    clearError();
    return id;
  } catch (err) {
    showError(`Could not import “${file.name}”: ${err.message}`);
    return null;
  }
}

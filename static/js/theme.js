// The page's theme and text size, kept in this browser (Settings → Appearance). A classic script in
// <head>, run before the page is drawn, so it never flashes the other theme; settings.js changes them.
(function appearance() {
  const KEY = 'chat.appearance';
  const THEMES = ['system', 'light', 'dark'];
  const SIZES = ['small', 'default', 'large'];

  function apply(chosen) {
    const root = document.documentElement;
    const theme = THEMES.includes(chosen.theme) ? chosen.theme : 'system';
    const text = SIZES.includes(chosen.text) ? chosen.text : 'default';
    if (theme === 'system') delete root.dataset.theme; else root.dataset.theme = theme;
    if (text === 'default') delete root.dataset.text; else root.dataset.text = text;
    // Code highlighting follows: each stylesheet applies to its own scheme.
    for (const scheme of ['light', 'dark']) {
      const link = document.getElementById(`hl-${scheme}`);
      if (link) link.media = theme === 'system' ? `(prefers-color-scheme: ${scheme})` : (theme === scheme ? 'all' : 'not all');
    }
    return { theme, text };
  }

  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(KEY) || '{}') || {}; } catch { saved = {}; }
  saved = apply(saved);
  window.chatAppearance = {
    get: () => ({ ...saved }),
    set(change) {
      saved = apply({ ...saved, ...change });
      try { localStorage.setItem(KEY, JSON.stringify(saved)); } catch { /* private mode */ }
    },
  };
}());

// Inline SVG icons shared by message actions and code blocks.
const svg = (paths) => `<svg viewBox="0 0 24 24" aria-hidden="true">${paths}</svg>`;

export const ICON_COPY = svg('<rect x="9" y="9" width="11" height="11" rx="2"/><path d="M5 15V5a1 1 0 0 1 1-1h9"/>');
export const ICON_CHECK = svg('<path d="M5 12l5 5L20 7"/>');
export const ICON_REGEN = svg('<path d="M20 11a8 8 0 1 0-2.3 5.7M20 5v6h-6"/>');

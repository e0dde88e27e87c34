// Inline SVG icons shared by message actions and code blocks.
const svg = (paths) => `<svg viewBox="0 0 24 24" aria-hidden="true">${paths}</svg>`;

export const ICON_COPY = svg('<rect x="9" y="9" width="11" height="11" rx="2"/><path d="M5 15V5a1 1 0 0 1 1-1h9"/>');
export const ICON_CHECK = svg('<path d="M5 12l5 5L20 7"/>');
export const ICON_REGEN = svg('<path d="M20 11a8 8 0 1 0-2.3 5.7M20 5v6h-6"/>');
export const ICON_EDIT = svg('<path d="M4 20h4L19 9l-4-4L4 16v4zM13.5 6.5l4 4"/>');
export const ICON_CONTINUE = svg('<path d="M5 12h12M13 6l6 6-6 6"/>');
export const ICON_BRANCH = svg('<circle cx="6" cy="5" r="2"/><circle cx="6" cy="19" r="2"/><circle cx="18" cy="8" r="2"/><path d="M6 7v10M18 10a6 6 0 0 1-6 6H8"/>');

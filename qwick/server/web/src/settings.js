// The user's settings, kept in localStorage (the conversations themselves live in IndexedDB).
const KEY = 'qwick.settings';

export const DEFAULTS = {
  systemPrompt: '',
  temperature: 0.7,
  topP: 0.8,
  maxTokens: 1024,
  model: '',
  apiKey: '',
  jsonMode: false,
  jsonSchema: '',
  theme: 'auto', // 'auto' follows the system; the header button sets 'light' or 'dark'
  showMetrics: true,
};

export function loadSettings() {
  try {
    return { ...DEFAULTS, ...JSON.parse(localStorage.getItem(KEY) || '{}') };
  } catch {
    return { ...DEFAULTS };
  }
}

export function saveSettings(settings) {
  localStorage.setItem(KEY, JSON.stringify(settings));
}

/** The theme in effect: the saved one, or the system's. */
export function effectiveTheme(settings) {
  if (settings.theme === 'light' || settings.theme === 'dark') return settings.theme;
  return matchMedia('(prefers-color-scheme: dark)').matches ? 'dark' : 'light';
}

export function applyTheme(settings) {
  const root = document.documentElement;
  if (settings.theme === 'light' || settings.theme === 'dark') root.dataset.theme = settings.theme;
  else delete root.dataset.theme;
}

/** `response_format` for the request, or undefined; throws on a schema that is not valid JSON. */
export function responseFormat(settings) {
  if (!settings.jsonMode) return undefined;
  const text = (settings.jsonSchema || '').trim();
  if (!text) return { type: 'json_object' };
  let schema;
  try {
    schema = JSON.parse(text);
  } catch (e) {
    throw new Error(`The JSON schema in Settings is not valid JSON: ${e.message}`);
  }
  return { type: 'json_schema', json_schema: { name: 'response', schema, strict: true } };
}

// The server's HTTP API: models, streamed chat completions (SSE) and /metrics.

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(apiKey, json = false) {
  const h = {};
  if (json) h['Content-Type'] = 'application/json';
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function failure(res) {
  let message = `${res.status} ${res.statusText}`;
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not the JSON error envelope: keep the status line
  }
  if (res.status === 401) message += ' (set the API key in Settings)';
  return new ApiError(res.status, message);
}

/** The ids of the served models. */
export async function listModels(apiKey) {
  const res = await fetch('v1/models', { headers: headers(apiKey) });
  if (!res.ok) throw await failure(res);
  const body = await res.json();
  return body.data.map((m) => m.id);
}

/** The Prometheus text of /metrics (served without a key). */
export async function fetchMetrics(signal) {
  const res = await fetch('metrics', { signal, cache: 'no-store' });
  if (!res.ok) throw await failure(res);
  return res.text();
}

/** The data payloads of an SSE stream, one string per event, until the stream ends. */
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  try {
    for (;;) {
      const { done, value } = await reader.read();
      buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, '');
        const data = event
          .split(/\r?\n/)
          .filter((line) => line.startsWith('data:'))
          .map((line) => line.slice(5).replace(/^ /, ''))
          .join('\n');
        if (data) yield data;
      }
      if (done) return;
    }
  } finally {
    reader.releaseLock();
  }
}

/**
 * Stream a chat completion: yields each parsed chunk (`choices[].delta`, `usage`, and qwick's timing
 * `qwick` on the last one). Aborting `signal` closes the connection, which makes the server abort the
 * request and free its KV cache.
 */
export async function* streamChat(body, { apiKey, signal }) {
  const res = await fetch('v1/chat/completions', {
    method: 'POST',
    headers: headers(apiKey, true),
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!res.ok) throw await failure(res);
  for await (const data of sseData(res.body)) {
    if (data === '[DONE]') return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(chunk.error.code || 500, chunk.error.message || 'the server failed');
    yield chunk;
  }
}

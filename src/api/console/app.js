// behest web console: plain JavaScript, no build step. Talks to the same HTTP API as any
// client: GET /providers, /sessions, /runs; POST /runs, /runs/{id}/cancel, /runs/{id}/tool_outputs
// and /runs/{id}/approvals (a run waiting for you shows a form); and watches a
// run with EventSource on /runs/{id}/events (which reconnects by itself with Last-Event-ID;
// events are applied once each, by sequence).
'use strict';

const $ = (id) => document.getElementById(id);

const EVENT_TYPES = [
  'run_started', 'context_built', 'model_started', 'model_retrying', 'text_delta',
  'reasoning_delta', 'tool_call_started', 'tool_call_delta', 'tool_call_completed',
  'tool_execution_started', 'tool_execution_finished', 'assistant_message_committed',
  'tool_message_committed', 'usage_recorded', 'cache_metrics', 'run_completed', 'run_failed',
  'run_cancelled', 'doom_loop_detected', 'context_compacted', 'compaction_circuit_opened',
  'run_resumed', 'tool_calls_required', 'context_compaction_started', 'output_rejected',
  'tool_progress',
  'tool_approval_decided',
];
const TERMINAL = new Set(['run_completed', 'run_failed', 'run_cancelled']);

let providers = [];
let view = null; // the run being shown: {runId, lastSeq, bubble, tools, es, done}

function apiKey() {
  return localStorage.getItem('behest.apiKey') || '';
}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (apiKey()) headers.Authorization = 'Bearer ' + apiKey();
  if (options.body !== undefined) headers['content-type'] = 'application/json';
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 204) return null;
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (response.status === 401) {
    // The server wants an API key: show where it goes.
    const keyBox = $('api-key').closest('details');
    if (keyBox) keyBox.open = true;
  }
  if (!response.ok) {
    const detail = body && (body.detail || body.title);
    const error = new Error(detail || ('HTTP ' + response.status));
    error.problem = body;
    error.status = response.status;
    throw error;
  }
  // The API answers: the notes of earlier refusals for want of a key are stale now.
  for (const stale of document.querySelectorAll('.note.auth')) stale.remove();
  return body;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function setState(text, kind) {
  const node = $('state');
  node.textContent = text;
  node.className = 'state ' + (kind || '');
  node.dataset.state = kind || text;
}

function short(id) {
  return id ? id.slice(-8) : '';
}

function when(iso) {
  try { return new Date(iso).toLocaleString(); } catch (_) { return iso; }
}

function json(value) {
  return typeof value === 'string' ? value : JSON.stringify(value);
}

// ---- providers and models

async function loadProviders() {
  const list = await api('/providers');
  providers = list.providers;
  const select = $('provider');
  select.replaceChildren();
  for (const provider of providers) {
    const option = el('option', null, provider.id + ' (' + provider.kind + ')');
    option.value = provider.id;
    select.append(option);
  }
  if (!providers.length) {
    $('model-info').textContent = 'No provider is configured on this server.';
  }
  fillModels();
}

function fillModels() {
  const provider = providers.find((p) => p.id === $('provider').value);
  const select = $('model');
  select.replaceChildren();
  for (const model of provider ? provider.models : []) {
    const option = el('option', null, model.name);
    option.value = model.name;
    select.append(option);
  }
  showModelInfo();
}

function showModelInfo() {
  const provider = providers.find((p) => p.id === $('provider').value);
  const model = provider && provider.models.find((m) => m.name === $('model').value);
  $('model-info').textContent = model
    ? 'Context window ' + model.context_window.toLocaleString() + ' tokens, up to '
      + model.max_output_tokens.toLocaleString() + ' output tokens.'
    : '';
}

// ---- recent runs and sessions

// The first 60 characters of each run's input (its user message), from the messages of the
// runs' sessions: one request per session, at most one page each; a run whose session could
// not be read (or whose input is further back) is shown without.
async function runInputs(runs) {
  const inputs = new Map();
  const sessions = [...new Set(runs.map((run) => run.session_id))];
  const wanted = new Set(runs.map((run) => run.id));
  await Promise.all(sessions.map(async (id) => {
    try {
      const page = await api('/sessions/' + id + '/messages?limit=200');
      for (const m of page.messages || []) {
        if (m.role !== 'user' || !wanted.has(m.run_id) || inputs.has(m.run_id)) continue;
        const text = (m.content || []).map((p) => p.text || (p.type === 'image' ? '[image]' : ''))
          .join(' ').replace(/\s+/g, ' ').trim();
        if (text) inputs.set(m.run_id, text.length > 60 ? text.slice(0, 59) + '…' : text);
      }
    } catch (_) { /* listed without its input */ }
  }));
  return inputs;
}

async function loadLists() {
  try {
    const [runs, sessions] = await Promise.all([
      api('/runs?limit=15'), api('/sessions?limit=15'),
    ]);
    const inputs = await runInputs(runs.runs);
    const runList = $('runs');
    runList.replaceChildren();
    for (const run of runs.runs) {
      // A run is known by its input; the status, model and time follow.
      const input = inputs.get(run.id);
      const button = el('button', null,
        (input ? '“' + input + '” · ' : '') + run.status + ' · ' + run.provider + '/' + run.model
        + ' · ' + when(run.created_at));
      button.type = 'button';
      button.dataset.runId = run.id;
      button.setAttribute('aria-label', 'Open run ' + short(run.id) + ', ' + run.status);
      button.addEventListener('click', () => openRun(run));
      const item = el('li');
      item.append(button);
      runList.append(item);
    }
    const sessionList = $('sessions');
    sessionList.replaceChildren();
    const select = $('session');
    const chosen = select.value;
    select.replaceChildren(Object.assign(el('option', null, 'New session'), { value: '' }));
    for (const session of sessions.sessions) {
      // A session is known by its title; an untitled one by its id's end.
      const name = session.title || ('Session …' + short(session.id));
      const button = el('button', null, name + ' · ' + when(session.updated_at));
      button.type = 'button';
      button.dataset.sessionId = session.id;
      button.addEventListener('click', () => openSession(session.id));
      const item = el('li');
      item.append(button);
      sessionList.append(item);
      const option = el('option', null, (session.title || '…' + short(session.id))
        + ' (' + when(session.updated_at) + ')');
      option.value = session.id;
      select.append(option);
    }
    select.value = chosen;
    if (select.value !== chosen) select.value = '';
  } catch (error) {
    errorNote($('transcript'), 'Could not list runs and sessions: ', error);
  }
}

function chooseSession(id) {
  const select = $('session');
  if (![...select.options].some((o) => o.value === id)) {
    const option = el('option', null, '…' + short(id));
    option.value = id;
    select.append(option);
  }
  select.value = id;
}

// ---- transcript

function note(parent, kind, text) {
  const node = el('div', 'note ' + kind, text);
  parent.append(node);
  return node;
}

/** An error note; one about a missing or wrong API key goes once a request succeeds. */
function errorNote(parent, text, error) {
  return note(parent, 'error' + (error && error.status === 401 ? ' auth' : ''), text + error.message);
}

/** The newest `keep` messages of a session (the API pages oldest first), with its compactions. */
async function newestMessages(sessionId, keep) {
  let messages = [];
  let compactions = [];
  let cursor = null;
  let older = 0;
  do {
    const page = await api('/sessions/' + sessionId + '/messages?limit=200'
      + (cursor ? '&cursor=' + encodeURIComponent(cursor) : ''));
    messages = messages.concat(page.messages || []);
    compactions = compactions.concat(page.compactions || []);
    if (messages.length > keep) {
      older += messages.length - keep;
      messages = messages.slice(-keep);
    }
    cursor = page.next_cursor;
  } while (cursor);
  return { messages, compactions, older };
}

function scrollToEnd() {
  const transcript = $('transcript');
  const last = transcript.lastElementChild;
  if (last) last.scrollIntoView({ block: 'end' });
}

function userMessage(parent, text, parts) {
  const node = el('div', 'msg user');
  node.append(el('span', 'who', 'You'), el('span', 'text', text));
  // Image parts of the input: shown when inline (a data: URL), named by their URL otherwise.
  for (const part of parts || []) {
    if (part.type !== 'image') continue;
    if (part.url.startsWith('data:image/')) {
      const img = document.createElement('img');
      img.className = 'input-image';
      img.alt = 'image (' + (part.media_type || part.mime_type || 'image') + ')';
      img.src = part.url;
      img.style.maxWidth = '240px';
      img.style.display = 'block';
      node.append(img);
    } else {
      node.append(el('span', 'muted', ' [image: ' + part.url + ']'));
    }
  }
  parent.append(node);
}

function assistantBubble(parent) {
  const node = el('div', 'msg assistant');
  const text = el('span', 'text');
  node.append(el('span', 'who', 'Assistant'), text);
  parent.append(node);
  return text;
}

function toolCard(parent, name) {
  const card = el('div', 'tool');
  card.append(el('strong', null, 'Tool call: ' + name));
  const args = el('pre', 'args');
  const result = el('pre', 'result');
  card.append(args, result);
  parent.append(card);
  return { card, args, result };
}

/** A compaction in a transcript: what it summarised, the token counts, the summary. */
function compactionNote(parent, compaction) {
  const node = note(parent, 'muted compaction', 'Context compacted (' + compaction.trigger + '): '
    + compaction.messages_summarised + ' messages summarised, ' + compaction.tokens_before
    + ' → ' + compaction.tokens_after + ' tokens');
  const summary = el('pre', 'summary', compaction.summary);
  node.append(summary);
  return node;
}

async function openSession(sessionId) {
  closeView();
  setState('loading…', 'loading');
  chooseSession(sessionId);
  const transcript = $('transcript');
  transcript.replaceChildren();
  try {
    // A long session opens at its newest messages, as a chat does.
    const messages = await newestMessages(sessionId, 200);
    if (messages.older) {
      note(transcript, 'muted older', messages.older + ' older messages are not shown.');
    }
    const cards = new Map();
    // Where each compaction happened: after the last message its summary covers.
    const compactedAt = new Map();
    for (const compaction of messages.compactions || []) {
      compactedAt.set(compaction.through_message_id, compaction);
    }
    for (const message of messages.messages || []) {
      const text = (message.content || []).map((part) =>
        part.type === 'text' ? part.text : part.type === 'json' ? json(part.value) : '').join('');
      if (message.role === 'user') userMessage(transcript, text, message.content);
      else if (message.role === 'assistant') {
        if (text) {
          const bubble = assistantBubble(transcript);
          bubble.textContent = text;
          // The text of a model call its run ended in (cancelled, failed).
          if (message.status === 'incomplete') bubble.append(el('em', 'muted', ' (incomplete)'));
        }
        for (const call of message.tool_calls || []) {
          const card = toolCard(transcript, call.name);
          card.args.textContent = call.invalid_arguments || json(call.arguments);
          cards.set(call.id, card);
        }
      } else if (message.role === 'tool') {
        const card = cards.get(message.tool_call_id) || toolCard(transcript, message.tool_name || 'tool');
        card.result.textContent = '→ ' + text;
      }
      const compaction = compactedAt.get(message.id);
      if (compaction) compactionNote(transcript, compaction);
    }
    setState('session …' + short(sessionId), 'idle');
    scrollToEnd();
  } catch (error) {
    errorNote(transcript, 'Could not open the session: ', error);
  }
}

async function openRun(run) {
  if (run.events_removed_at) {
    // Retention removed the run's events (its stream answers 410): show its session instead.
    await openSession(run.session_id);
    note($('transcript'), 'muted', 'The events of run …' + short(run.id)
      + ' were removed by retention; its messages are shown above.');
    return;
  }
  closeView();
  setState('loading…', 'loading');
  chooseSession(run.session_id);
  const transcript = $('transcript');
  transcript.replaceChildren();
  note(transcript, 'muted', 'Run …' + short(run.id) + ' (' + run.provider + '/' + run.model + ')');
  try {
    const messages = await api('/sessions/' + run.session_id + '/messages');
    const input = (messages.messages || []).find((m) => m.run_id === run.id && m.role === 'user');
    if (input) userMessage(transcript, input.content.map((p) => p.text || '').join(''), input.content);
  } catch (_) { /* the events still replay */ }
  watch(run.id, transcript);
}

// ---- a run, live

function closeView() {
  if (view && view.es) view.es.close();
  view = null;
  $('cancel').disabled = true;
}

function watch(runId, transcript) {
  const current = { runId, lastSeq: 0, bubble: null, tools: new Map(), es: null, done: false };
  view = current;
  transcript.dataset.runId = runId;
  let url = '/runs/' + runId + '/events';
  if (apiKey()) url += '?access_token=' + encodeURIComponent(apiKey());
  const es = new EventSource(url);
  current.es = es;
  const handle = (frame) => {
    if (view !== current) return;
    let event;
    try { event = JSON.parse(frame.data); } catch (_) { return; }
    // A reconnect resumes after the last id the browser saw; never apply an event twice.
    if (event.sequence <= current.lastSeq) return;
    current.lastSeq = event.sequence;
    transcript.dataset.lastSequence = String(event.sequence);
    const shown = transcript.children.length;
    apply(current, transcript, event);
    // What each event added is tagged with its sequence, so a `run_resumed` can take back what
    // an abandoned model call showed.
    for (const node of Array.from(transcript.children).slice(shown)) {
      node.dataset.sequence = String(event.sequence);
    }
  };
  for (const type of EVENT_TYPES) es.addEventListener(type, handle);
  es.onopen = () => {
    if (!current.done && view === current) setState('running', 'running');
  };
  es.onerror = () => {
    if (current.done || view !== current) return;
    if (es.readyState === EventSource.CLOSED) {
      setState('stream closed', 'failed');
      $('cancel').disabled = true;
    } else {
      setState('reconnecting…', 'running');
    }
  };
  $('cancel').disabled = false;
  setState('running', 'running');
}

// A run paused in `requires_action`: one form for every call it waits on, answered at once (the
// outputs of the tools the client executes, as JSON or text; approve or reject the others).
function actionForm(current, transcript, event) {
  const form = el('form', 'action');
  form.append(el('strong', null, 'The run waits for you'));
  const answers = [];
  for (const call of event.tool_calls || []) {
    const row = el('div', 'pending');
    const what = call.tool_name + '(' + json(call.arguments) + ')';
    if (call.kind === 'approval') {
      const choice = el('select');
      for (const [value, label] of [['approve', 'Approve'], ['reject', 'Reject']]) {
        choice.append(Object.assign(el('option', null, label), { value }));
      }
      choice.setAttribute('aria-label', 'Decision on ' + call.tool_name);
      const reason = el('input');
      reason.placeholder = 'reason (shown to the model when rejected)';
      reason.setAttribute('aria-label', 'Reason for ' + call.tool_name);
      row.append(el('span', null, 'Run ' + what + '?'), choice, reason);
      answers.push({ call, choice, reason });
    } else {
      const output = el('textarea');
      output.rows = 2;
      output.placeholder = 'its output: JSON or text';
      output.setAttribute('aria-label', 'Output of ' + call.tool_name);
      row.append(el('span', null, 'Your tool ' + what + ' returns:'), output);
      answers.push({ call, output });
    }
    form.append(row);
  }
  const send = el('button', null, 'Answer the run');
  send.type = 'submit';
  form.append(send);
  form.addEventListener('submit', async (submitEvent) => {
    submitEvent.preventDefault();
    send.disabled = true;
    const parse = (text) => { try { return JSON.parse(text); } catch (_) { return text; } };
    const outputs = answers.filter((a) => a.output)
      .map((a) => ({ call_id: a.call.call_id, output: parse(a.output.value) }));
    const approvals = answers.filter((a) => a.choice).map((a) => ({
      call_id: a.call.call_id,
      approve: a.choice.value === 'approve',
      reason: a.reason.value || undefined,
    }));
    try {
      const run = '/runs/' + current.runId;
      if (outputs.length) {
        await api(run + '/tool_outputs', { method: 'POST', body: JSON.stringify({ tool_outputs: outputs }) });
      }
      if (approvals.length) {
        await api(run + '/approvals', { method: 'POST', body: JSON.stringify({ approvals }) });
      }
      form.remove();
      if (!current.done) setState('running', 'running');
    } catch (error) {
      note(form, 'error', 'Could not answer: ' + error.message);
      send.disabled = false;
    }
  });
  transcript.append(form);
  current.action = form;
}

function apply(current, transcript, event) {
  // The run went on: a form for its last wait has no use any more.
  if (current.action && ['model_started', 'tool_approval_decided', 'tool_execution_started', 'tool_execution_finished',
    'run_completed', 'run_failed', 'run_cancelled'].includes(event.type)) {
    current.action.remove();
    current.action = null;
  }
  switch (event.type) {
    case 'model_started':
      current.bubble = null;
      current.callText = null;
      break;

    case 'tool_calls_required':
      current.bubble = null;
      current.callText = null;
      actionForm(current, transcript, event);
      setState('waiting for you', 'waiting');
      break;
    case 'text_delta':
      if (!current.bubble) current.bubble = assistantBubble(transcript);
      current.bubble.textContent += event.delta;
      current.callText = current.bubble;
      break;
    case 'reasoning_delta':
      break;
    case 'model_retrying':
      note(transcript, 'muted', 'Retrying the model call (' + (event.error_class || '') + ')…');
      break;
    case 'tool_call_started':
      current.bubble = null;
      current.tools.set(event.call_id, toolCard(transcript, event.tool_name));
      break;
    case 'tool_call_delta': {
      const card = current.tools.get(event.call_id);
      if (card) card.args.textContent += event.delta;
      break;
    }
    case 'tool_call_completed': {
      const call = event.call;
      const card = current.tools.get(call.id) || toolCard(transcript, call.name);
      current.tools.set(call.id, card);
      card.args.textContent = call.invalid_arguments || json(call.arguments);
      break;
    }
    case 'tool_execution_started':
      // The model call ended whole (its tools run): a later end does not cut its text.
      current.callText = null;
      break;
    case 'tool_execution_finished': {
      const card = current.tools.get(event.call_id) || toolCard(transcript, event.tool_name);
      const result = event.result || {};
      card.result.textContent = result.Success
        ? '→ ' + json(result.Success.output) + ' (' + event.duration_ms + ' ms)'
        : '→ failed: ' + ((result.Failure && result.Failure.error) || 'unknown error');
      break;
    }
    case 'tool_progress': {
      // The latest report replaces the one before, until the result does.
      const card = current.tools.get(event.call_id);
      if (card) {
        const of = event.total != null ? ' / ' + event.total : '';
        card.result.textContent = '… ' + event.progress + of
          + (event.message ? ' — ' + event.message : '');
      }
      break;
    }
    case 'usage_recorded': {
      const u = event.usage;
      note(transcript, 'usage', 'Usage: ' + u.input_tokens + ' in, ' + u.output_tokens
        + ' out, ' + u.total_tokens + ' total tokens' + (u.estimated ? ' (estimated)' : ''));
      break;
    }
    case 'doom_loop_detected':
      note(transcript, 'doom', 'Doom loop detected: ' + event.description);
      break;
    case 'context_compaction_started':
      // The summariser is working (seconds to minutes with a large local model): say so until
      // `context_compacted`, or the next event, says how it went.
      current.bubble = null;
      note(transcript, 'muted', 'Compacting the context (' + event.trigger + '): summarising '
        + event.messages_to_summarise + ' messages of about ' + event.tokens_before
        + ' tokens with ' + event.model + '…');
      setState('compacting', 'running');
      break;
    case 'context_compacted':
      current.bubble = null;
      compactionNote(transcript, event);
      setState('running', 'running');
      break;
    case 'compaction_circuit_opened':
      note(transcript, 'error', 'Compaction circuit breaker opened after '
        + event.consecutive_failures + ' failed compactions: no compaction is attempted until it is reset.');
      break;
    case 'run_resumed':
      // The server restarted. The model call that began at `abandoned_after` was cut off and is
      // made again: drop what the console showed of it (its text, tool calls, usage).
      if (event.abandoned_after != null) {
        for (const node of Array.from(transcript.children)) {
          if (Number(node.dataset.sequence) > event.abandoned_after) node.remove();
        }
        for (const [id, card] of current.tools) {
          if (!card.card.isConnected) current.tools.delete(id);
        }
      }
      current.bubble = null;
      note(transcript, 'muted', 'The server restarted; the run goes on.');
      break;
    case 'tool_approval_decided': {
      // Who decided what, also when the run is replayed later.
      const who = [event.decided_by, event.api_key != null ? 'API key #' + event.api_key : null]
        .filter((part) => part != null).join(', ');
      note(transcript, event.approved ? 'muted' : 'error', (event.approved ? 'Approved: ' : 'Rejected: ')
        + event.tool_name + (who ? ' by ' + who : '') + (event.reason ? ' (' + event.reason + ')' : ''));
      break;
    }
    case 'output_rejected':
      // The answer did not match the run's output_schema: the model is asked again.
      current.bubble = null;
      current.callText = null;
      note(transcript, 'muted', 'The answer does not match the output schema (correction '
        + event.attempt + '): ' + (Array.isArray(event.errors)
          ? event.errors.map(function (e) {
            return e.instance_path ? e.instance_path + ': ' + e.message : e.message;
          }).join('; ')
          : event.errors));
      break;
    case 'run_failed':
      note(transcript, 'error', 'Run failed' + (event.error_class ? ' (' + event.error_class + ')' : '')
        + ': ' + event.error);
      break;
    default:
      break;
  }
  if (TERMINAL.has(event.type)) {
    // The run ended in the middle of a model call: its text is kept as it was, incomplete (as
    // the session's history shows it).
    if (event.type !== 'run_completed' && current.callText) {
      current.callText.append(el('em', 'muted', ' (incomplete)'));
      current.callText = null;
    }
    current.done = true;
    current.es.close();
    $('cancel').disabled = true;
    const status = event.type.replace('run_', '');
    const detail = event.type === 'run_completed'
      ? ' (' + event.finish_reason + ', ' + event.iterations + ' model call' + (event.iterations === 1 ? '' : 's') + ')'
      : '';
    note(transcript, 'terminal', 'Run ' + status + detail);
    setState(status, status);
    loadLists();
  }
}

async function send(submitEvent) {
  submitEvent.preventDefault();
  const input = $('input').value.trim();
  if (!input) return;
  const sessionId = $('session').value;
  const transcript = $('transcript');
  const body = { provider: $('provider').value, model: $('model').value, input };
  if (sessionId) body.session_id = sessionId;
  $('send').disabled = true;
  try {
    const created = await api('/runs', { method: 'POST', body: JSON.stringify(body) });
    // Only a started run replaces the view: a refused one (e.g. session_busy) leaves the run
    // being watched live and cancellable.
    closeView();
    if (!sessionId) transcript.replaceChildren();
    userMessage(transcript, input);
    $('input').value = '';
    chooseSession(created.session_id);
    watch(created.run_id, transcript);
    loadLists();
  } catch (error) {
    note(transcript, 'error', 'Could not start the run: ' + error.message);
    if (!view || view.done) setState('error', 'failed');
  } finally {
    $('send').disabled = false;
  }
}

async function cancel() {
  if (!view || view.done) return;
  const current = view;
  $('cancel').disabled = true;
  setState('cancelling…', 'running');
  try {
    await api('/runs/' + current.runId + '/cancel', { method: 'POST' });
  } catch (error) {
    note($('transcript'), 'error', 'Could not cancel: ' + error.message);
  }
}

function init() {
  $('run-form').addEventListener('submit', send);
  $('cancel').addEventListener('click', cancel);
  $('provider').addEventListener('change', fillModels);
  $('model').addEventListener('change', showModelInfo);
  $('input').addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $('run-form').requestSubmit();
    }
  });
  $('session').addEventListener('change', () => {
    const id = $('session').value;
    if (id) openSession(id);
    else { closeView(); $('transcript').replaceChildren(); setState('idle', 'idle'); }
  });
  const key = $('api-key');
  key.value = apiKey();
  key.addEventListener('change', () => {
    localStorage.setItem('behest.apiKey', key.value.trim());
    loadProviders().then(loadLists).catch(() => {});
  });
  loadProviders()
    .catch((error) => errorNote($('transcript'), 'Could not list providers: ', error))
    .then(loadLists);
}

init();

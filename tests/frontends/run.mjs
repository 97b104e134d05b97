// The real frontend readers against a running behest (started by tests/it/frontends.rs):
// `ai` 6 and `ai` 7 (DefaultChatTransport's own response parsing + readUIMessageStream) and
// `@ag-ui/client` 1.0 (an HttpAgent subclass whose connect() re-attaches with Last-Event-ID,
// run through connectAgent's enforce/verify/apply pipeline). For each run (text, server tool,
// client tool, approval) every segment is read once live, then cut after each frame (so also
// inside a multi-frame event) and resumed from that frame's id; the message each library
// builds must equal GET /runs/{id}/output. Any library error fails: exit code 1.
//
// Usage: node run.mjs <base url>

import * as ai6 from "ai6";
import * as ai7 from "ai7";
import { HttpAgent, runHttpRequest, transformHttpEventStream } from "@ag-ui/client";

const base = process.argv[2];
if (!base) throw new Error("usage: node run.mjs <base url>");
process.env.SUPPRESS_TRANSFORMATION_WARNINGS = "true";

async function api(method, path, body) {
  const response = await fetch(base + path, {
    method,
    headers: body === undefined ? {} : { "content-type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  if (!response.ok) throw new Error(`${method} ${path}: ${response.status} ${text}`);
  return text ? JSON.parse(text) : null;
}

/// The raw SSE frames of one response: [{id, data}], and the response's headers.
async function frames(runId, format, cursor) {
  const headers = cursor ? { "last-event-id": cursor } : {};
  const response = await fetch(`${base}/runs/${runId}/events?format=${format}`, { headers });
  if (response.status === 204) return { status: 204, frames: [] };
  if (response.status !== 200) throw new Error(`GET events: ${response.status} ${await response.text()}`);
  const text = await response.text();
  if (text.includes("\r")) throw new Error("CR in the stream");
  const out = [];
  for (const block of text.split("\n\n")) {
    const lines = block.split("\n").filter((line) => line && !line.startsWith(":"));
    if (lines.length === 0) continue;
    const frame = { id: null, data: null };
    for (const line of lines) {
      if (line.startsWith("id: ")) frame.id = line.slice(4);
      else if (line.startsWith("data: ")) frame.data = line.slice(6);
      else throw new Error(`unexpected line ${JSON.stringify(line)}`);
    }
    out.push(frame);
  }
  return { status: 200, headers: response.headers, frames: out };
}

const sse = (list) => list.map((f) => (f.id ? `id: ${f.id}\n` : "") + `data: ${f.data}\n\n`).join("");

/// A fetch whose response body is `prefix` (already-read frames) then, from a GET with the
/// cut's id as Last-Event-ID, the rest: what a client that lost its connection reads.
function bodyOf(text) {
  return new Response(text, { headers: { "content-type": "text/event-stream" } });
}

function expected(output) {
  const texts = output.messages
    .map((m) => m.content.filter((p) => p.type === "text").map((p) => p.text).join(""))
    .join("");
  const calls = output.messages.flatMap((m) => (m.tool_calls ?? []).map((c) => [c.id, c.name, c.arguments]));
  return { texts, calls };
}

function strip(id) {
  const parts = id.split(":");
  if (parts.length < 3) throw new Error(`tool call id ${id} is not namespaced`);
  return parts.slice(2).join(":");
}

function same(label, got, want) {
  const a = JSON.stringify(got);
  const b = JSON.stringify(want);
  if (a !== b) throw new Error(`${label}: got ${a}, want ${b}`);
}

// ---------------------------------------------------------------- AI SDK

/// The chunks DefaultChatTransport parses (and validates) from an SSE body.
async function* chunks(lib, text) {
  const transport = new lib.DefaultChatTransport({
    api: `${base}/unused`,
    fetch: async () => bodyOf(text),
  });
  const stream = await transport.reconnectToStream({ chatId: "c" });
  const reader = stream.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    yield value;
  }
}

/// Reads `text` (one or more responses' bodies) through readUIMessageStream, continuing
/// `message`; the last message it built.
async function readMessage(lib, text, message) {
  let last = message;
  const stream = new ReadableStream({
    async start(controller) {
      for await (const chunk of chunks(lib, text)) controller.enqueue(chunk);
      controller.close();
    },
  });
  let failure = null;
  for await (const m of lib.readUIMessageStream({
    stream,
    message: message && structuredClone(message),
    onError: (e) => {
      failure = e;
    },
    terminateOnError: true,
  })) {
    last = m;
  }
  if (failure) throw failure;
  return structuredClone(last);
}

function fromUi(message) {
  const texts = message.parts.filter((p) => p.type === "text").map((p) => p.text).join("");
  const calls = message.parts
    .filter((p) => p.type === "dynamic-tool" || p.type.startsWith("tool-"))
    .map((p) => [strip(p.toolCallId), p.toolName ?? p.type.slice(5), p.input]);
  return { texts, calls };
}

async function aiSdk(lib, format, runId, segments) {
  let message;
  let cursor;
  let cuts = 0;
  for (const segment of segments) {
    const { frames: list, headers } = segment;
    if (headers.get("x-vercel-ai-ui-message-stream") !== "v1") throw new Error("header missing");
    if (list.at(-1).data !== "[DONE]" || list.at(-1).id !== null) throw new Error("no [DONE] at the end");
    const replay = await frames(runId, format, cursor);
    same(`${format} replay == live`, replay.frames, list);
    // Cut after every frame with an id: the prefix, then the resumed rest, into one reader.
    for (let i = 0; i < list.length; i++) {
      if (!list[i].id) continue;
      const rest = await frames(runId, format, list[i].id);
      const remainder = rest.status === 204 ? [] : rest.frames;
      if (i + 1 < list.length && i < list.length - 2) {
        same(`${format} resume at ${list[i].id}`, remainder, list.slice(i + 1));
      }
      const joined = i + 1 < list.length - 1 ? sse(list.slice(0, i + 1)) + sse(remainder) : sse(list);
      const built = await readMessage(lib, joined, message);
      if (i === list.length - 2) same(`${format} whole`, built.id, runId);
      cuts++;
    }
    message = await readMessage(lib, sse(list), message);
    cursor = list.filter((f) => f.id).at(-1).id;
  }
  return { message, cuts };
}

// ---------------------------------------------------------------- AG-UI

/// HttpAgent that re-attaches to a run's AG-UI stream at `cursor` (the few lines an app adds).
class BehestAgent extends HttpAgent {
  constructor({ base: url, runId, threadId, fetch: f }) {
    super({ url: `${url}/ag-ui`, threadId, fetch: f });
    this.base = url;
    this.runId = runId;
    this.cursor = undefined;
  }
  connect() {
    const headers = { accept: "text/event-stream" };
    if (this.cursor) headers["last-event-id"] = this.cursor;
    const url = `${this.base}/runs/${this.runId}/events?format=ag-ui`;
    return transformHttpEventStream(runHttpRequest(() => this.fetch(url, { headers }), this.debugLogger));
  }
}

function fromAgUi(messages) {
  const texts = messages
    .filter((m) => m.role === "assistant" && typeof m.content === "string")
    .map((m) => m.content)
    .join("");
  const calls = messages
    .filter((m) => m.role === "assistant")
    .flatMap((m) => (m.toolCalls ?? []).map((c) => [strip(c.id), c.function.name, JSON.parse(c.function.arguments)]));
  return { texts, calls };
}

/// An agent reading the run's stream, each response cut (clean end) after its first `take`
/// frames, then re-attached at the last id it read until the run's end; its messages.
async function agUiRead(runId, threadId, lastSegmentEnd, cutAt) {
  let served = [];
  const agent = new BehestAgent({
    base,
    runId,
    threadId,
    fetch: async (url, init) => {
      const cursor = init.headers["last-event-id"];
      const response = await frames(runId, "ag-ui", cursor);
      const list = response.frames;
      // Every prelude frame carries the cursor as id; the rest are the next frames.
      const cut = cutAt(cursor, list);
      served = list.slice(0, cut);
      return bodyOf(sse(served));
    },
  });
  const failures = [];
  agent.subscribe({ onRunFailed: ({ error }) => failures.push(error) });
  for (let round = 0; round < 500; round++) {
    // An approval's interrupt is answered through behest's own route; the agent only needs
    // to be told it was resolved.
    const resume = agent.pendingInterrupts.map((i) => ({ interruptId: i.id, status: "resolved", payload: { approved: true } }));
    await agent.connectAgent(resume.length ? { runId, resume } : { runId });
    if (failures.length) throw failures[0];
    const last = served.filter((f) => f.id).at(-1);
    if (!last) throw new Error("nothing served");
    agent.cursor = last.id;
    if (last.id === lastSegmentEnd) return agent.messages;
  }
  throw new Error("did not reach the end");
}

// ---------------------------------------------------------------- runs

async function waitFor(runId, statuses) {
  for (let i = 0; i < 400; i++) {
    const run = await api("GET", `/runs/${runId}`);
    if (statuses.includes(run.status)) return run;
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error(`run ${runId} never reached ${statuses}`);
}

/// Starts a run, reads every segment of it live in `format`, answering each pause with
/// `answer`; the segments' frames.
async function liveRun(body, format, answer) {
  const { run_id: runId, session_id: sessionId } = await api("POST", "/runs", body);
  const segments = [];
  let cursor;
  for (;;) {
    const segment = await frames(runId, format, cursor);
    if (segment.status === 204) break;
    segments.push(segment);
    cursor = segment.frames.filter((f) => f.id).at(-1).id;
    const run = await waitFor(runId, ["requires_action", "completed", "failed", "cancelled"]);
    if (run.status !== "requires_action") break;
    await answer(runId, run.required_action);
  }
  const output = await api("GET", `/runs/${runId}/output`);
  if (output.status !== "completed") throw new Error(`run ${runId} ${output.status}: ${output.error}`);
  return { runId, sessionId, segments, output };
}

const clientTool = { name: "get_location", description: "Where the user is" };
const runs = {
  text: { body: { provider: "demo", model: "demo", input: "Hello there, frontends." } },
  server_tool: { body: { provider: "demo", model: "demo", input: "What time is it?" } },
  client_tool: {
    body: { provider: "demo", model: "demo", input: "call get_location", tools: [clientTool] },
    answer: (runId, action) =>
      api("POST", `/runs/${runId}/tool_outputs`, {
        tool_outputs: action.tool_calls.map((c) => ({ call_id: c.call_id, output: { city: "Oslo" } })),
      }),
  },
  approval: {
    body: { provider: "demo", model: "demo", input: "What time is it?", approval: ["current_time"] },
    answer: (runId, action) =>
      api("POST", `/runs/${runId}/approvals`, {
        approvals: action.tool_calls.map((c) => ({ call_id: c.call_id, approve: true, decided_by: "alice" })),
      }),
  },
};

/// A run cancelled mid-text: each reader takes the cancel's frames (AI SDK `abort` + `finish`,
/// AG-UI `RUN_FINISHED {outcome: cancelled}`) and keeps the text that was streamed, as the
/// run's output does (an `incomplete` assistant message).
async function cancelled(format, lib) {
  const { run_id: runId, session_id: sessionId } = await api("POST", "/runs", {
    provider: "demo",
    model: "demo",
    input: "count to 400",
  });
  const live = fetch(`${base}/runs/${runId}/events?format=${format}`).then((r) => r.text());
  await new Promise((r) => setTimeout(r, 400));
  await api("POST", `/runs/${runId}/cancel?wait=true`);
  const text = await live;
  const output = await api("GET", `/runs/${runId}/output`);
  same(`cancelled ${format} status`, output.status, "cancelled");
  const want = expected(output);
  if (format === "ag-ui") {
    const last = JSON.parse(text.trim().split("\n").at(-1).slice(6));
    same("cancelled ag-ui outcome", last.outcome, { type: "cancelled" });
    const messages = await agUiRead(runId, sessionId, text.match(/id: (\S+)\n[^\n]*\n\n$/)[1], (_, list) => list.length);
    same("cancelled ag-ui messages", fromAgUi(messages), want);
  } else {
    if (!/"type":"abort"/.test(text) || !text.endsWith("data: [DONE]\n\n")) throw new Error(`no abort/[DONE]: ${text.slice(-300)}`);
    const message = await readMessage(lib, text, undefined);
    same(`cancelled ${format} message`, fromUi(message), want);
  }
  report.push(`cancelled ${format}${lib ? ` (ai ${lib === ai6 ? 6 : 7})` : ""}: ok`);
}

const report = [];
await cancelled("ai-sdk", ai6);
await cancelled("ai-sdk", ai7);
await cancelled("ai-sdk-v7", ai7);
await cancelled("ag-ui");
for (const [name, run] of Object.entries(runs)) {
  for (const [format, lib] of [["ai-sdk", ai6], ["ai-sdk", ai7], ["ai-sdk-v7", ai7]]) {
    const live = await liveRun(run.body, format, run.answer ?? (async () => {}));
    const { message, cuts } = await aiSdk(lib, format, live.runId, live.segments);
    same(`${name} ${format} message id`, message.id, live.runId);
    same(`${name} ${format} message`, fromUi(message), expected(live.output));
    if (name === "approval" && format === "ai-sdk-v7") {
      // The logged decision reaches ai 7's tool part as its approval response.
      const part = message.parts.find((p) => p.type === "tool-current_time");
      same(`${name} ${format} approval`, part?.approval?.approved, true);
    }
    if (live.segments.length === 1) {
      // The README's snippet, as written (but for the base URL and the format).
      const transport = new lib.DefaultChatTransport({
        api: `${base}/runs`,
        prepareReconnectToStreamRequest: ({ id }) => ({ api: `${base}/runs/${id}/events?format=${format}` }),
      });
      const stream = await transport.reconnectToStream({ chatId: live.runId });
      let last;
      for await (const m of lib.readUIMessageStream({ stream })) last = m;
      same(`${name} ${format} README snippet`, fromUi(last), expected(live.output));
    }
    report.push(`${name} ${format} (ai ${lib === ai6 ? 6 : 7}): ${live.segments.length} segment(s), ${cuts} cuts`);
  }
  const live = await liveRun(run.body, "ag-ui", run.answer ?? (async () => {}));
  const all = live.segments.flatMap((s) => s.frames);
  const end = all.filter((f) => f.id).at(-1).id;
  const want = expected(live.output);
  const history = await api("GET", `/sessions/${live.sessionId}/messages`);
  const stored = history.messages.filter((m) => m.run_id === live.runId).map((m) => m.id);
  // Read whole, then with every response cut after k frames past its prelude (k = 1, 2, 3…).
  let reads = 0;
  for (const k of [Infinity, 1, 2, 3, 5, 8]) {
    const messages = await agUiRead(live.runId, live.sessionId, end, (cursor, list) => {
      const prelude = cursor ? list.filter((f) => f.id === cursor).length : 0;
      return Math.min(list.length, prelude + k);
    });
    same(`${name} ag-ui cut every ${k}`, fromAgUi(messages), want);
    // Its assistant messages carry the ids behest stores them with.
    const assistants = messages.filter((m) => m.role === "assistant").map((m) => m.id);
    if (assistants.length === 0) throw new Error(`${name} ag-ui: no assistant message`);
    for (const id of assistants) {
      if (!stored.includes(id)) throw new Error(`${name} ag-ui: message ${id} is not among the stored ${stored}`);
    }
    reads++;
  }
  report.push(`${name} ag-ui: ${live.segments.length} segment(s), ${all.length} frames, ${reads} cut patterns`);
}
console.log(report.join("\n"));

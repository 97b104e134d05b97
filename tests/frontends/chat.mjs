// The real clients against behest's request-side endpoints (started by tests/it/chat.rs):
// `ai` 6 and `ai` 7's `AbstractChat` (the class `useChat` and `@ai-sdk/react`'s `Chat` wrap,
// with a plain state) over `DefaultChatTransport` against `POST /chat` and
// `GET /chat/{id}/stream`, and `@ag-ui/client`'s `HttpAgent` — the README's `BehestAgent`
// subclass, verbatim but for its types — against `POST /ag-ui` and the re-attach route.
// Each run's final message must equal GET /runs/{id}/output; any library error fails
// (exit code 1). Prints one "ok <case>" line per case.
//
// Usage: node chat.mjs <base url>
//        node chat.mjs <base url> restart   (driven by tests/it/frontends.rs: a `kill -9` of
//        the server mid-run, then `resumeStream()` against the restarted one; see
//        `restartCases`)

import * as ai6 from "ai6";
import * as ai7 from "ai7";
import { HttpAgent, runHttpRequest, transformHttpEventStream } from "@ag-ui/client";

let base = process.argv[2];
if (!base) throw new Error("usage: node chat.mjs <base url> [restart]");
process.env.SUPPRESS_TRANSFORMATION_WARNINGS = "true";

// ag-ui #2510: a cut connection leaves an unhandled rejection in runHttpRequest's teardown.
// Only the cuts this script makes are forgiven.
const CUT = "network error (cut by the test)";
process.on("unhandledRejection", (reason) => {
  if (String(reason?.message ?? reason).includes(CUT)) return;
  console.error("unhandled rejection:", reason);
  process.exit(1);
});

async function api(method, path) {
  const response = await fetch(base + path, { method });
  const text = await response.text();
  return { status: response.status, body: text ? JSON.parse(text) : null };
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function until(label, condition, ms = 20000) {
  const end = Date.now() + ms;
  for (;;) {
    const value = await condition();
    if (value) return value;
    if (Date.now() > end) throw new Error(`timed out waiting for ${label}`);
    await sleep(25);
  }
}

function same(label, got, want) {
  const a = JSON.stringify(got);
  const b = JSON.stringify(want);
  if (a !== b) throw new Error(`${label}: got ${a}, want ${b}`);
}

function strip(id) {
  const parts = id.split(":");
  if (parts.length < 3) throw new Error(`tool call id ${id} is not namespaced`);
  return parts.slice(2).join(":");
}

/// What GET /runs/{id}/output says the run produced: its text and its tool calls.
async function output(runId) {
  const { status, body } = await api("GET", `/runs/${runId}/output`);
  if (status !== 200) throw new Error(`GET /runs/${runId}/output: ${status}`);
  const texts = body.messages
    .map((m) => m.content.filter((p) => p.type === "text").map((p) => p.text).join(""))
    .join("");
  const calls = body.messages.flatMap((m) => (m.tool_calls ?? []).map((c) => [c.id, c.name, c.arguments]));
  return { status: body.status, texts, calls };
}

/// A fetch whose first POST's body is cut (a network error) right after the first chunk that
/// contains `marker`; everything else passes.
function cutAfter(marker) {
  let armed = true;
  return async (url, init) => {
    const response = await fetch(url, init);
    if (!armed || init?.method !== "POST" || !response.body) return response;
    armed = false;
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let seen = "";
    let cut = false;
    const body = new ReadableStream({
      async pull(controller) {
        if (cut) {
          reader.cancel().catch(() => {});
          controller.error(new TypeError(CUT));
          return;
        }
        const { done, value } = await reader.read();
        if (done) return controller.close();
        seen += decoder.decode(value, { stream: true });
        controller.enqueue(value);
        if (seen.includes(marker)) cut = true;
      },
    });
    return new Response(body, response);
  };
}

// ---------------------------------------------------------------- AI SDK

/// The state `useChat` keeps in React, kept in plain fields.
class PlainState {
  constructor() {
    this.status = "ready";
    this.error = undefined;
    this.messages = [];
  }
  pushMessage = (message) => {
    this.messages = this.messages.concat(message);
  };
  popMessage = () => {
    this.messages = this.messages.slice(0, -1);
  };
  replaceMessage = (index, message) => {
    this.messages = [...this.messages.slice(0, index), this.snapshot(message), ...this.messages.slice(index + 1)];
  };
  snapshot = (thing) => structuredClone(thing);
}

function newChat(lib, format, { body, fetch: fetchFn, onToolCall, sendAutomaticallyWhen, errors, lastOnly }) {
  class Chat extends lib.AbstractChat {
    constructor(init) {
      super({ ...init, state: new PlainState() });
    }
  }
  const transport = new lib.DefaultChatTransport({
    api: `${base}/chat?format=${format}`,
    body: { provider: "demo", model: "demo", ...body },
    ...(fetchFn ? { fetch: fetchFn } : {}),
    // The README's long-chat lines: only the last message is sent.
    ...(lastOnly
      ? {
          prepareSendMessagesRequest: ({ id, messages, trigger, messageId, body }) => ({
            body: { ...body, id, messages: messages.slice(-1), trigger, messageId },
          }),
        }
      : {}),
  });
  return new Chat({
    transport,
    onToolCall,
    sendAutomaticallyWhen,
    onError: (error) => errors.push(error),
  });
}

/// The chat's last assistant message against the run's output: same id (the run id), same
/// text, same tool calls (ids namespaced on the wire).
async function checkAgainstOutput(label, chat, { status = "completed" } = {}) {
  const message = chat.messages.at(-1);
  if (message?.role !== "assistant") throw new Error(`${label}: no assistant message`);
  const run = await output(message.id);
  same(`${label}: run status`, run.status, status);
  const texts = message.parts.filter((p) => p.type === "text").map((p) => p.text).join("");
  same(`${label}: text`, texts, run.texts);
  const calls = message.parts
    .filter((p) => p.type.startsWith("tool-") || p.type === "dynamic-tool")
    .map((p) => [strip(p.toolCallId), p.type === "dynamic-tool" ? p.toolName : p.type.slice(5), p.input]);
  same(`${label}: tool calls`, calls, run.calls);
  const assistants = chat.messages.filter((m) => m.role === "assistant").length;
  same(`${label}: one assistant message per run`, assistants, chat.messages.filter((m) => m.role === "user").length);
  return message;
}

async function settled(label, chat, errors) {
  await until(`${label}: chat ready`, () => chat.status === "ready" || chat.status === "error");
  if (errors.length) throw new Error(`${label}: ${errors.map(String).join("; ")}`);
  same(`${label}: chat status`, chat.status, "ready");
}

async function aiSdkCases(name, lib, format) {
  // A text run.
  {
    const errors = [];
    const chat = newChat(lib, format, { errors });
    await chat.sendMessage({ text: "Hello there" });
    await settled(`${name} text`, chat, errors);
    await checkAgainstOutput(`${name} text`, chat);
    // A second message in the same chat: the same session.
    await chat.sendMessage({ text: "count to 3" });
    await settled(`${name} text 2`, chat, errors);
    await checkAgainstOutput(`${name} text 2`, chat);
    console.log(`ok text ${name}`);
  }
  // A client tool: onToolCall + addToolOutput + sendAutomaticallyWhen.
  {
    const errors = [];
    let calls = 0;
    // Sending only the last message, as the README's long-chat lines do.
    const chat = newChat(lib, format, {
      errors,
      lastOnly: true,
      body: { tools: [{ name: "get_location", description: "Where the user is" }] },
      sendAutomaticallyWhen: lib.lastAssistantMessageIsCompleteWithToolCalls,
      onToolCall: ({ toolCall }) => {
        calls += 1;
        chat.addToolOutput({ tool: "get_location", toolCallId: toolCall.toolCallId, output: { city: "Paris" } });
      },
    });
    await chat.sendMessage({ text: "call get_location" });
    const runId = chat.messages.at(-1).id;
    await until(`${name} client tool: run completed`, async () => (await api("GET", `/runs/${runId}`)).body.status === "completed");
    await settled(`${name} client tool`, chat, errors);
    const message = await checkAgainstOutput(`${name} client tool`, chat);
    same(`${name} client tool: onToolCall`, calls, 1);
    if (!message.parts.some((p) => p.type === "tool-get_location" && p.state === "output-available")) {
      throw new Error(`${name} client tool: the tool part has no output`);
    }
    console.log(`ok client_tool ${name}`);
  }
  // An approval: addToolApprovalResponse + sendAutomaticallyWhen.
  {
    const errors = [];
    const chat = newChat(lib, format, {
      errors,
      body: { approval: ["current_time"] },
      sendAutomaticallyWhen: lib.lastAssistantMessageIsCompleteWithApprovalResponses,
    });
    await chat.sendMessage({ text: "What time is it?" });
    await settled(`${name} approval (asked)`, chat, errors);
    const asked = chat.messages.at(-1).parts.find((p) => p.state === "approval-requested");
    if (!asked) throw new Error(`${name} approval: no approval request in ${JSON.stringify(chat.messages.at(-1))}`);
    await chat.addToolApprovalResponse({ id: asked.approval.id, approved: true });
    const runId = chat.messages.at(-1).id;
    await until(`${name} approval: run completed`, async () => (await api("GET", `/runs/${runId}`)).body.status === "completed");
    await settled(`${name} approval`, chat, errors);
    await checkAgainstOutput(`${name} approval`, chat);
    console.log(`ok approval ${name}`);
  }
  // A cut mid-text, then resumeStream(): GET /chat/{id}/stream replays the run in progress.
  {
    const errors = [];
    const chat = newChat(lib, format, { errors, fetch: cutAfter('"text-delta"') });
    await chat.sendMessage({ text: "count to 40" }).catch(() => {});
    await until(`${name} cut: the cut`, () => chat.status === "error" || errors.length > 0);
    errors.length = 0;
    await chat.resumeStream();
    await settled(`${name} cut`, chat, errors);
    await checkAgainstOutput(`${name} cut`, chat);
    console.log(`ok cut_resume ${name}`);
  }
  // stop(): the client disconnects and POST /chat/{id}/stop cancels the run.
  {
    const errors = [];
    const runs = [];
    const recording = async (url, init) => {
      const response = await fetch(url, init);
      runs.push(response.headers.get("x-run-id"));
      return response;
    };
    const chat = newChat(lib, format, { errors, fetch: recording });
    const sent = chat.sendMessage({ text: "count to 400" });
    await until(`${name} stop: text`, () => {
      const last = chat.messages.at(-1);
      return last?.role === "assistant" && last.parts.some((p) => p.type === "text" && p.text.length > 0);
    });
    const runId = chat.messages.at(-1).id;
    same(`${name} stop: the message is the run's (${JSON.stringify(chat.messages)})`, runId, runs.at(-1));
    await chat.stop();
    await sent.catch(() => {});
    const stopped = await api("POST", `/chat/${encodeURIComponent(chat.id)}/stop`);
    same(`${name} stop: status (${JSON.stringify(stopped.body)})`, stopped.status, 202);
    same(`${name} stop: run`, stopped.body.id, runId);
    await until(`${name} stop: cancelled`, async () => (await api("GET", `/runs/${runId}`)).body.status === "cancelled");
    const run = await output(runId);
    const texts = chat.messages.at(-1).parts.filter((p) => p.type === "text").map((p) => p.text).join("");
    if (!run.texts.startsWith(texts)) throw new Error(`${name} stop: ${JSON.stringify(texts)} is not a prefix of the output`);
    same(`${name} stop: nothing to resume`, (await api("GET", `/chat/${encodeURIComponent(chat.id)}/stream`)).status, 204);
    console.log(`ok stop ${name}`);
  }
}

// ---------------------------------------------------------------- AG-UI

// The README's BehestAgent, without its TypeScript types.
class BehestAgent extends HttpAgent {
  behestRunId;
  lastEventId = "";
  constructor(config) {
    super(config);
    const plain = this.fetch;
    this.fetch = async (url, init) => {
      const response = await plain(url, init);
      this.behestRunId = response.headers.get("x-run-id") ?? this.behestRunId;
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let rest = "";
      return new Response(new ReadableStream({ pull: async (out) => {
        try {
          const { done, value } = await reader.read();
          if (done) return out.close();
          rest += decoder.decode(value, { stream: true });
          const end = rest.lastIndexOf("\n\n"); // the id of the last whole frame
          for (const m of rest.slice(0, end + 1).matchAll(/^id: (.*)$/gm)) this.lastEventId = m[1];
          rest = rest.slice(end + 2);
          out.enqueue(value);
        } catch (error) { // let the frames read so far be applied before the failure
          await new Promise((resolve) => setTimeout(resolve, 0));
          out.error(error);
        }
      } }), response);
    };
  }
  requestInit(input) {
    let from = input.messages.length - 1;
    while (from > 0 && input.messages[from].role === "tool") from--;
    return super.requestInit({ ...input, messages: input.messages.slice(Math.max(from, 0)) });
  }
  connect(input) {
    const url = new URL(`/runs/${this.behestRunId}/events?format=ag-ui`, this.url);
    return transformHttpEventStream(runHttpRequest(() => this.fetch(url.toString(), {
      headers: { ...this.headers, Accept: "text/event-stream", "Last-Event-ID": this.lastEventId },
      signal: this.abortController.signal,
    })));
  }
}

/// The agent's messages of the run against its output: the assistant text and the calls.
async function checkAgent(label, agent, runId) {
  const run = await output(runId);
  same(`${label}: run status`, run.status, "completed");
  const lastUser = agent.messages.findLastIndex((m) => m.role === "user");
  const mine = agent.messages.slice(lastUser + 1);
  const texts = mine.filter((m) => m.role === "assistant").map((m) => m.content ?? "").join("");
  same(`${label}: text`, texts, run.texts);
  const calls = mine
    .filter((m) => m.role === "assistant")
    .flatMap((m) => (m.toolCalls ?? []).map((c) => [strip(c.id), c.function.name, JSON.parse(c.function.arguments || "{}")]));
  same(`${label}: tool calls`, calls, run.calls);
}

const forwardedProps = { provider: "demo", model: "demo" };

async function agUiCases() {
  // A client tool: RUN_FINISHED with pendingToolCallIds, a tool message, the continuation.
  {
    const agent = new BehestAgent({ url: `${base}/ag-ui` });
    const tools = [{ name: "get_location", description: "Where the user is", parameters: { type: "object", properties: {} } }];
    agent.addMessage({ id: "u1", role: "user", content: "call get_location" });
    await agent.runAgent({ tools, forwardedProps });
    const runId = agent.behestRunId;
    const call = agent.messages.at(-1).toolCalls?.[0];
    if (!call) throw new Error(`ag-ui client tool: no pending call in ${JSON.stringify(agent.messages)}`);
    agent.addMessage({ id: "t1", role: "tool", toolCallId: call.id, content: "Paris" });
    await agent.runAgent({ tools, forwardedProps });
    same("ag-ui client tool: same run", agent.behestRunId, runId);
    await checkAgent("ag-ui client tool", agent, runId);
    console.log("ok client_tool ag-ui");
  }
  // An approval: an interrupt outcome, answered through resume[].
  {
    const agent = new BehestAgent({ url: `${base}/ag-ui` });
    agent.addMessage({ id: "u1", role: "user", content: "What time is it?" });
    await agent.runAgent({ forwardedProps: { ...forwardedProps, approval: ["current_time"] } });
    const runId = agent.behestRunId;
    const interrupt = agent.pendingInterrupts[0];
    if (!interrupt) throw new Error("ag-ui approval: no interrupt");
    await agent.runAgent({ resume: [{ interruptId: interrupt.id, status: "resolved", payload: { approved: true } }] });
    await checkAgent("ag-ui approval", agent, runId);
    console.log("ok approval ag-ui");
  }
  // A cut mid-text, then connectAgent(): the README's re-attach.
  {
    const agent = new BehestAgent({ url: `${base}/ag-ui`, fetch: cutAfter("TEXT_MESSAGE_CONTENT") });
    agent.addMessage({ id: "u1", role: "user", content: "count to 40" });
    let failed = false;
    try {
      await agent.runAgent({ forwardedProps });
    } catch {
      failed = true;
    }
    same("ag-ui cut: runAgent failed", failed, true);
    await agent.connectAgent();
    await checkAgent("ag-ui cut", agent, agent.behestRunId);
    console.log("ok cut_reattach ag-ui");
  }
}

// ---------------------------------------------------------------- kill -9 and restart

/// The next line the driving test writes on stdin.
const lines = (async function* () {
  let rest = "";
  for await (const chunk of process.stdin) {
    rest += chunk;
    for (let end = rest.indexOf("\n"); end >= 0; end = rest.indexOf("\n")) {
      yield rest.slice(0, end);
      rest = rest.slice(end + 1);
    }
  }
})();

/// For each reader: a chat's run streamed through POST /chat, cut by a `kill -9` of the server
/// mid-text (the test kills it when this prints `kill`), then, against the restarted server
/// (whose URL the test writes on stdin), the chat's own `resumeStream()` — what `useChat` calls
/// on mount (`GET /chat/{id}/stream`, a full replay then live). The restarted process took the
/// run over (`run_resumed` with the abandoned call): in ai 7's dialect `reset-step` drops the
/// abandoned text and the message equals GET /runs/{id}/output; ai 6 cannot retract text, so
/// its message ends with the output's.
async function restartCases() {
  for (const [name, lib, format] of [
    ["ai-sdk-v7 (ai 7)", ai7, "ai-sdk-v7"],
    ["ai-sdk (ai 6)", ai6, "ai-sdk"],
  ]) {
    const errors = [];
    const first = base;
    // The transport's URLs name the first server; a restarted one listens elsewhere.
    const moved = (url, init) => fetch(String(url).replace(first, base), init);
    const chat = newChat(lib, format, { errors, fetch: moved });
    const sent = chat.sendMessage({ text: "count to 300" }).catch(() => {});
    await until(`${name} restart: text`, () => {
      const last = chat.messages.at(-1);
      return last?.role === "assistant" && last.parts.some((p) => p.type === "text" && p.text.length > 0);
    });
    const runId = chat.messages.at(-1).id;
    console.log(`kill ${runId}`);
    base = (await lines.next()).value;
    if (!base) throw new Error(`${name} restart: no restarted server`);
    await sent;
    await until(`${name} restart: the cut`, () => chat.status === "error" || errors.length > 0 || chat.status === "ready");
    errors.length = 0;
    await chat.resumeStream();
    await until(`${name} restart: run completed`, async () => (await api("GET", `/runs/${runId}`)).body?.status === "completed", 60000);
    await settled(`${name} restart`, chat, errors);
    const message = chat.messages.at(-1);
    same(`${name} restart: the run's message`, message.id, runId);
    const log = await (await fetch(`${base}/runs/${runId}/events`)).text();
    if (!/"type":"run_resumed","iteration":\d+,"abandoned_after":\d+/.test(log)) {
      throw new Error(`${name} restart: the run was not taken over mid-call:\n${log}`);
    }
    const run = await output(runId);
    const texts = message.parts.filter((p) => p.type === "text").map((p) => p.text).join("");
    if (format === "ai-sdk-v7") {
      await checkAgainstOutput(`${name} restart`, chat);
    } else if (!texts.endsWith(run.texts)) {
      throw new Error(`${name} restart: ${JSON.stringify(texts)} does not end with ${JSON.stringify(run.texts)}`);
    }
    console.log(`ok restart ${name}`);
  }
}

if (process.argv[3] === "restart") {
  try {
    await restartCases();
  } catch (error) {
    console.error(error);
    process.exit(1);
  }
  process.exit(0);
}

try {
  await aiSdkCases("ai-sdk (ai 6)", ai6, "ai-sdk");
  await aiSdkCases("ai-sdk (ai 7)", ai7, "ai-sdk");
  await aiSdkCases("ai-sdk-v7 (ai 7)", ai7, "ai-sdk-v7");
  await agUiCases();
} catch (error) {
  console.error(error);
  process.exit(1);
}
process.exit(0);

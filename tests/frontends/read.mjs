// Reads one saved AI SDK UI message stream (SSE text on stdin) through the real reader
// (DefaultChatTransport's parsing and validation, then readUIMessageStream) and prints the
// message it builds as JSON. Any library error: exit code 1. Used by tests/it/frontends.rs.
//
// Usage: node read.mjs ai6|ai7 < stream.txt

import * as ai6 from "ai6";
import * as ai7 from "ai7";

const lib = { ai6, ai7 }[process.argv[2]];
if (!lib) throw new Error("usage: node read.mjs ai6|ai7 < stream");
let text = "";
for await (const chunk of process.stdin) text += chunk;
const transport = new lib.DefaultChatTransport({
  api: "http://unused",
  fetch: async () => new Response(text, { headers: { "content-type": "text/event-stream" } }),
});
const stream = await transport.reconnectToStream({ chatId: "c" });
let message;
let failure;
for await (const m of lib.readUIMessageStream({ stream, onError: (e) => (failure = e), terminateOnError: true })) {
  message = m;
}
if (failure) throw failure;
console.log(JSON.stringify(message));

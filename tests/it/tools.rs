//! The tool registry against real servers: the stdio MCP fixture (a child process), the same
//! fixture served in-process over streamable HTTP, and HTTP tools on a local axum server.

#[path = "../../src/bin/behest-mcp-fixture.rs"]
#[expect(dead_code, reason = "the fixture binary's `main` is not used here")]
mod fixture;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::Json;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse as _;
use axum::routing::post;
use behest::config::{HttpToolConfig, McpServerConfig};
use behest::tools::{ToolError, ToolRegistry, ToolSetupError, ToolSource};
use serde_json::{Value, json};

const FIXTURE: &str = env!("CARGO_BIN_EXE_behest-mcp-fixture");

fn stdio_fixture(log: &Path) -> BTreeMap<String, McpServerConfig> {
    BTreeMap::from([(
        "fixture".to_owned(),
        McpServerConfig::Stdio {
            idempotent_tools: Vec::new(),
            requires_approval_tools: Vec::new(),
            command: FIXTURE.to_owned(),
            args: Vec::new(),
            inherit_env: Vec::new(),
            env: BTreeMap::from([(
                "BEHEST_MCP_FIXTURE_LOG".to_owned(),
                log.display().to_string(),
            )]),
        },
    )])
}

struct Fixture {
    registry: ToolRegistry,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Fixture {
    async fn stdio() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("fixture.log");
        let registry = ToolRegistry::connect(&stdio_fixture(&log), &BTreeMap::new())
            .await
            .unwrap();
        Self {
            registry,
            log,
            _dir: dir,
        }
    }

    fn log_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Waits up to `within` for a log line starting with `prefix`.
    async fn wait_for_line(&self, prefix: &str, within: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(line) = self.log_lines().into_iter().find(|l| l.starts_with(prefix)) {
                return Some(line);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test]
async fn lists_every_page_of_mcp_tools_with_schemas_and_sources() {
    let fixture = Fixture::stdio().await;
    let tools = fixture.registry.list();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["add", "echo", "fail", "sleep"]);
    for tool in &tools {
        assert_eq!(
            tool.source,
            ToolSource::Mcp {
                server: "fixture".to_owned(),
                transport: "stdio".to_owned()
            }
        );
        assert!(!tool.description.is_empty());
    }
    assert_eq!(tools[0].parameters["required"], json!(["a", "b"]));
    assert_eq!(tools[0].parameters["properties"]["a"]["type"], "number");
    assert!(fixture.registry.contains("sleep"));
    assert!(!fixture.registry.contains("nope"));

    let all = fixture.registry.specs(None);
    assert_eq!(all.len(), 4);
    assert_eq!(all[1].name, "echo");
    assert_eq!(all[1].parameters, tools[1].parameters);
    let allowed = ["sleep".to_owned(), "missing".to_owned(), "add".to_owned()];
    let some: Vec<String> = fixture
        .registry
        .specs(Some(&allowed))
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(some, ["sleep", "add"]);
    fixture.registry.shutdown().await;
}

#[tokio::test]
async fn mcp_calls_return_structured_text_and_errors() {
    let fixture = Fixture::stdio().await;
    let registry = &fixture.registry;

    let sum = registry
        .call("add", &json!({"a": 2, "b": 3.5}))
        .await
        .unwrap();
    assert_eq!(sum, json!({"sum": 5.5}));

    let echoed = registry
        .call("echo", &json!({"text": "héllo"}))
        .await
        .unwrap();
    assert_eq!(echoed, json!("héllo"));

    let failed = registry.call("fail", &json!({})).await;
    assert_eq!(
        failed,
        Err(ToolError::Failed("this tool always fails".to_owned()))
    );

    let unknown = registry.call("nope", &json!({})).await;
    assert_eq!(unknown, Err(ToolError::UnknownTool("nope".to_owned())));

    let slept = registry.call("sleep", &json!({"ms": 1})).await.unwrap();
    assert_eq!(slept, json!("slept"));
    registry.shutdown().await;
    assert!(matches!(
        registry.call("echo", &json!({"text": "x"})).await,
        Err(ToolError::Failed(_))
    ));
}

#[tokio::test]
async fn invalid_arguments_never_reach_the_server() {
    let fixture = Fixture::stdio().await;
    let registry = &fixture.registry;

    let Err(ToolError::InvalidArguments { tool, reason }) =
        registry.call("add", &json!({"a": 1})).await
    else {
        panic!("missing `b` accepted");
    };
    assert_eq!(tool, "add");
    assert!(reason.contains("\"b\""), "{reason}");

    let Err(ToolError::InvalidArguments { reason, .. }) =
        registry.call("add", &json!({"a": "one", "b": true})).await
    else {
        panic!("wrong types accepted");
    };
    // Every violation is listed, with where it is.
    assert!(reason.contains("/a") && reason.contains("/b"), "{reason}");

    assert!(matches!(
        registry.call("echo", &json!("text")).await,
        Err(ToolError::InvalidArguments { .. })
    ));
    registry.call("echo", &json!({"text": "ok"})).await.unwrap();
    let calls: Vec<String> = fixture
        .log_lines()
        .into_iter()
        .filter(|l| l.starts_with("called "))
        .collect();
    assert_eq!(
        calls,
        ["called echo"],
        "only the valid call reached the server"
    );
    registry.shutdown().await;
}

#[tokio::test]
async fn dropping_an_mcp_call_sends_the_cancellation() {
    let fixture = Fixture::stdio().await;
    let long = json!({"ms": 10_000});
    let call = fixture.registry.call("sleep", &long);
    let outcome = tokio::time::timeout(Duration::from_millis(200), call).await;
    assert!(outcome.is_err(), "the sleep should still be running");
    let line = fixture
        .wait_for_line("cancelled ", Duration::from_secs(1))
        .await;
    assert!(line.is_some(), "no cancellation: {:?}", fixture.log_lines());
    assert!(fixture.log_lines().contains(&"called sleep".to_owned()));
    // The session stays usable after a cancelled call.
    let echoed = fixture
        .registry
        .call("echo", &json!({"text": "after"}))
        .await;
    assert_eq!(echoed, Ok(json!("after")));
    fixture.registry.shutdown().await;
}

/// Whether process `pid` still runs (a zombie counts as gone).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit(')')
            .next()
            .is_some_and(|rest| !rest.trim_start().starts_with('Z'))
    })
}

async fn wait_until_gone(pid: u32, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while running(pid) {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

async fn fixture_pid(fixture: &Fixture) -> u32 {
    let line = fixture
        .wait_for_line("started ", Duration::from_secs(1))
        .await
        .unwrap();
    line["started ".len()..].parse().unwrap()
}

#[tokio::test]
async fn shutdown_and_drop_end_the_child_process() {
    let fixture = Fixture::stdio().await;
    let pid = fixture_pid(&fixture).await;
    assert!(running(pid));
    fixture.registry.shutdown().await;
    assert!(
        wait_until_gone(pid, Duration::from_secs(5)).await,
        "still running after shutdown"
    );
    // A second shutdown is harmless.
    fixture.registry.shutdown().await;

    let Fixture {
        registry,
        log,
        _dir,
    } = Fixture::stdio().await;
    let dropped = Fixture {
        registry: ToolRegistry::default(),
        log,
        _dir,
    };
    let pid = fixture_pid(&dropped).await;
    drop(registry);
    assert!(
        wait_until_gone(pid, Duration::from_secs(5)).await,
        "still running after drop"
    );
}

#[tokio::test]
async fn a_server_that_cannot_start_is_named() {
    let servers = BTreeMap::from([(
        "ghost".to_owned(),
        McpServerConfig::Stdio {
            idempotent_tools: Vec::new(),
            requires_approval_tools: Vec::new(),
            command: "/nonexistent/behest-no-such-server".to_owned(),
            args: Vec::new(),
            inherit_env: Vec::new(),
            env: BTreeMap::new(),
        },
    )]);
    let error = ToolRegistry::connect(&servers, &BTreeMap::new())
        .await
        .unwrap_err();
    let ToolSetupError::Mcp { server, .. } = &error else {
        panic!("{error}");
    };
    assert_eq!(server, "ghost");

    // A program that exits at once (never speaks MCP) fails the same way.
    let servers = BTreeMap::from([(
        "mute".to_owned(),
        McpServerConfig::Stdio {
            idempotent_tools: Vec::new(),
            requires_approval_tools: Vec::new(),
            command: "true".to_owned(),
            args: Vec::new(),
            inherit_env: Vec::new(),
            env: BTreeMap::new(),
        },
    )]);
    let error = ToolRegistry::connect(&servers, &BTreeMap::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&error, ToolSetupError::Mcp { server, .. } if server == "mute"),
        "{error}"
    );
}

// --- HTTP tools ---------------------------------------------------------------------------

/// A local HTTP tool server: `/echo` answers `{"got": body, "key": x-api-key,
/// "idempotency_key": Idempotency-Key}`, `/boom` 500s,
/// `/text` answers plain text.
async fn http_tool_server() -> String {
    async fn echo(headers: HeaderMap, Json(body): Json<Value>) -> Json<Value> {
        let key = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let idempotency_key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        Json(json!({"got": body, "key": key, "idempotency_key": idempotency_key}))
    }
    let app = axum::Router::new()
        .route("/echo", post(echo))
        .route(
            "/boom",
            post(|| async {
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "boom: the backend fell over",
                )
            }),
        )
        .route("/text", post(|| async { "plain words" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{address}")
}

fn http_tool(url: String, headers: &[(&str, &str)]) -> HttpToolConfig {
    HttpToolConfig {
        idempotent: false,
        requires_approval: false,
        description: "An HTTP tool.".to_owned(),
        url,
        parameters: json!({
            "type": "object",
            "properties": {"q": {"type": "string"}},
            "required": ["q"]
        }),
        headers: headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

#[tokio::test]
async fn http_tools_post_arguments_and_map_responses() {
    let base = http_tool_server().await;
    let tools = BTreeMap::from([
        (
            "lookup".to_owned(),
            http_tool(format!("{base}/echo"), &[("X-Api-Key", "k-123")]),
        ),
        ("broken".to_owned(), http_tool(format!("{base}/boom"), &[])),
        ("words".to_owned(), http_tool(format!("{base}/text"), &[])),
    ]);
    let registry = ToolRegistry::connect(&BTreeMap::new(), &tools)
        .await
        .unwrap();
    let listed = registry.list();
    assert_eq!(listed[1].name, "lookup");
    assert_eq!(
        listed[1].source,
        ToolSource::Http {
            url: format!("{base}/echo")
        }
    );

    let result = registry
        .call("lookup", &json!({"q": "rust"}))
        .await
        .unwrap();
    assert_eq!(
        result,
        json!({"got": {"q": "rust"}, "key": "k-123", "idempotency_key": null})
    );

    let Err(ToolError::Failed(message)) = registry.call("broken", &json!({"q": "x"})).await else {
        panic!("a 500 must fail");
    };
    assert!(message.contains("500"), "{message}");
    assert!(message.contains("boom: the backend"), "{message}");

    let words = registry.call("words", &json!({"q": "x"})).await.unwrap();
    assert_eq!(words, json!("plain words"));

    assert!(matches!(
        registry.call("lookup", &json!({})).await,
        Err(ToolError::InvalidArguments { .. })
    ));
}

#[tokio::test]
async fn dropping_an_http_call_aborts_the_request() {
    /// Reports when the server drops the handler (hyper does once the client is gone).
    struct Dropped(Option<tokio::sync::oneshot::Sender<()>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            if let Some(sender) = self.0.take() {
                let _ = sender.send(());
            }
        }
    }
    let (sender, dropped) = tokio::sync::oneshot::channel();
    let sender = std::sync::Arc::new(std::sync::Mutex::new(Some(sender)));
    let app = axum::Router::new().route(
        "/slow",
        post(move || {
            let guard = Dropped(sender.lock().unwrap().take());
            async move {
                tokio::time::sleep(Duration::from_secs(10)).await;
                drop(guard);
                "late"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let tools = BTreeMap::from([(
        "slow".to_owned(),
        http_tool(format!("http://{address}/slow"), &[]),
    )]);
    let registry = ToolRegistry::connect(&BTreeMap::new(), &tools)
        .await
        .unwrap();
    let arguments = json!({"q": "x"});
    let call = registry.call("slow", &arguments);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), call)
            .await
            .is_err()
    );
    let aborted = tokio::time::timeout(Duration::from_secs(1), dropped).await;
    assert!(matches!(aborted, Ok(Ok(()))), "the server kept the request");
}

#[tokio::test]
async fn an_unreachable_http_tool_fails_the_call_not_the_registry() {
    let tools = BTreeMap::from([(
        "gone".to_owned(),
        http_tool("http://127.0.0.1:9/".to_owned(), &[]),
    )]);
    let registry = ToolRegistry::connect(&BTreeMap::new(), &tools)
        .await
        .unwrap();
    assert!(matches!(
        registry.call("gone", &json!({"q": "x"})).await,
        Err(ToolError::Failed(message)) if message.contains("gone")
    ));
}

#[tokio::test]
async fn duplicate_names_and_bad_schemas_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let tools = BTreeMap::from([(
        "add".to_owned(),
        http_tool("http://127.0.0.1:9/add".to_owned(), &[]),
    )]);
    let error = ToolRegistry::connect(&stdio_fixture(&log), &tools)
        .await
        .unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, ToolSetupError::Invalid(_)), "{message}");
    assert!(message.contains("`add`"), "{message}");
    assert!(message.contains("`fixture`"), "{message}");
    assert!(message.contains("http://127.0.0.1:9/add"), "{message}");

    let mut bad = http_tool("http://127.0.0.1:9/".to_owned(), &[]);
    bad.parameters = json!({"type": 12});
    let tools = BTreeMap::from([("bad".to_owned(), bad)]);
    let error = ToolRegistry::connect(&BTreeMap::new(), &tools)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, ToolSetupError::Invalid(m) if m.contains("`bad`")),
        "{error}"
    );
}

// --- streamable HTTP MCP ------------------------------------------------------------------

/// Serves the fixture over streamable HTTP at `http://…/mcp`, requiring `x-token: t`.
async fn streamable_http_fixture(log: PathBuf) -> String {
    use rmcp::transport::StreamableHttpService;
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;

    let service: StreamableHttpService<fixture::Fixture, LocalSessionManager> =
        StreamableHttpService::new(
            move || {
                Ok(fixture::Fixture {
                    log: Some(log.clone()),
                })
            },
            Default::default(),
            Default::default(),
        );
    let app = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn(
            |request: axum::extract::Request, next: axum::middleware::Next| async move {
                if request.headers().get("x-token").is_none_or(|v| v != "t") {
                    return StatusCode::UNAUTHORIZED.into_response();
                }
                next.run(request).await
            },
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{address}/mcp")
}

#[tokio::test]
async fn streamable_http_mcp_server_lists_calls_and_cancels() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let url = streamable_http_fixture(log.clone()).await;
    let servers = BTreeMap::from([(
        "remote".to_owned(),
        McpServerConfig::Http {
            idempotent_tools: Vec::new(),
            requires_approval_tools: Vec::new(),
            url: url.clone(),
            headers: BTreeMap::from([("x-token".to_owned(), "t".to_owned())]),
        },
    )]);
    let registry = ToolRegistry::connect(&servers, &BTreeMap::new())
        .await
        .unwrap();
    let fixture = Fixture {
        registry,
        log,
        _dir: dir,
    };
    let tools = fixture.registry.list();
    assert_eq!(tools.len(), 4);
    assert_eq!(
        tools[0].source,
        ToolSource::Mcp {
            server: "remote".to_owned(),
            transport: "http".to_owned()
        }
    );
    let sum = fixture.registry.call("add", &json!({"a": 1, "b": 2})).await;
    assert_eq!(sum, Ok(json!({"sum": 3.0})));

    let long = json!({"ms": 10_000});
    let call = fixture.registry.call("sleep", &long);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), call)
            .await
            .is_err()
    );
    let line = fixture
        .wait_for_line("cancelled ", Duration::from_secs(1))
        .await;
    assert!(line.is_some(), "no cancellation: {:?}", fixture.log_lines());
    fixture.registry.shutdown().await;

    // Without the header the server refuses, and the registry names the server.
    let servers = BTreeMap::from([(
        "remote".to_owned(),
        McpServerConfig::Http {
            idempotent_tools: Vec::new(),
            requires_approval_tools: Vec::new(),
            url,
            headers: BTreeMap::new(),
        },
    )]);
    let error = ToolRegistry::connect(&servers, &BTreeMap::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&error, ToolSetupError::Mcp { server, .. } if server == "remote"),
        "{error}"
    );
}

#[tokio::test]
async fn idempotent_tools_must_be_tools_of_their_server() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let with = |names: &[&str]| {
        let mut servers = stdio_fixture(&log);
        if let Some(McpServerConfig::Stdio {
            idempotent_tools, ..
        }) = servers.get_mut("fixture")
        {
            *idempotent_tools = names.iter().map(|n| (*n).to_owned()).collect();
        }
        servers
    };
    let registry = ToolRegistry::connect(&with(&["add"]), &BTreeMap::new())
        .await
        .unwrap();
    assert!(registry.is_idempotent("add"));
    assert!(!registry.is_idempotent("sleep"));
    let listed = registry.list();
    assert!(listed.iter().any(|t| t.name == "add" && t.idempotent));
    registry.shutdown().await;

    // A typo would silently turn a re-execution into an "interrupted" result: refused.
    let error = ToolRegistry::connect(&with(&["add", "nope"]), &BTreeMap::new())
        .await
        .expect_err("an unknown idempotent tool is refused");
    let message = error.to_string();
    assert!(
        matches!(&error, ToolSetupError::Invalid(m) if m.contains("idempotent_tools") && m.contains("`nope`") && m.contains("add, echo, fail, sleep")),
        "{message}"
    );
}

/// Each execution carries its call's idempotency key (`<run id>:<call id>`, unsafe characters
/// percent-encoded): an HTTP tool as `Idempotency-Key`, an MCP tool in `_meta`.
#[tokio::test]
async fn tool_executions_carry_their_idempotency_key() {
    let run_id = behest::domain::RunId(uuid::Uuid::now_v7());
    let key = behest::tools::idempotency_key(run_id, "call_1");
    assert_eq!(key, format!("{run_id}:call_1"));
    assert_eq!(
        behest::tools::idempotency_key(run_id, "a b%\u{7}é"),
        format!("{run_id}:a%20b%25%07%C3%A9")
    );

    let base = http_tool_server().await;
    let tools = BTreeMap::from([("lookup".to_owned(), http_tool(format!("{base}/echo"), &[]))]);
    let registry = ToolRegistry::connect(&BTreeMap::new(), &tools)
        .await
        .unwrap();
    let keyed = registry
        .call_keyed("lookup", &json!({"q": "x"}), Some(&key))
        .await
        .unwrap();
    assert_eq!(keyed["idempotency_key"], json!(key));
    let plain = registry.call("lookup", &json!({"q": "x"})).await.unwrap();
    assert_eq!(plain["idempotency_key"], Value::Null);

    let fixture = Fixture::stdio().await;
    fixture
        .registry
        .call_keyed("echo", &json!({"text": "hi"}), Some(&key))
        .await
        .unwrap();
    let line = fixture
        .wait_for_line("key echo", Duration::from_secs(5))
        .await;
    assert_eq!(line, Some(format!("key echo {key}")));
    fixture.registry.shutdown().await;
}

//! The README's agent sections are copy-pasteable: their shell blocks (curl) run as they are
//! against `behest serve` started as the README says — with no configuration (the built-in
//! `demo` model) or with `--config examples/agents.toml` — and print what the README shows.

use crate::support;

use std::time::Duration;

use support::demo::DemoServer;
use support::process::ServerProcess;

const README: &str = include_str!("../../README.md");

/// The `n`th ```sh block after the heading `heading`, without `cargo run` lines.
fn block(heading: &str, n: usize) -> String {
    let start = README
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("README has `{heading}`"));
    let mut rest = &README[start..];
    let mut found = None;
    for _ in 0..=n {
        let open = rest.find("```sh\n").expect("a sh block") + "```sh\n".len();
        let close = rest[open..].find("```").expect("its end") + open;
        found = Some(rest[open..close].to_owned());
        rest = &rest[close + 3..];
    }
    found
        .unwrap()
        .lines()
        .filter(|line| !line.starts_with("cargo run"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs `script` with bash against `host` (for `localhost:8080`); returns what it printed.
async fn run(script: &str, host: &str) -> String {
    let script = script.replace("localhost:8080", host);
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new("bash")
            .args(["-e", "-c", &script])
            .output(),
    )
    .await
    .expect("the block ends within 60 s")
    .expect("run bash");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "the block failed ({}):\n{script}\n--- stdout\n{stdout}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test]
async fn the_client_tool_and_approval_round_trips_run_against_the_demo() {
    let server = DemoServer::start().await;
    let host = server.url.trim_start_matches("http://").to_owned();

    let out = run(&block("### Tools the client executes", 0), &host).await;
    assert!(out.contains("\"status\":\"requires_action\""), "{out}");
    assert!(
        out.contains(r#""tool_calls":[{"call_id":"call_1","tool_name":"get_location","arguments":{},"kind":"client_tool"},{"call_id":"call_2","tool_name":"get_weather","arguments":{"unit":"C"},"kind":"client_tool"}]"#),
        "{out}"
    );
    assert!(out.contains("event: tool_calls_required"), "{out}");
    assert!(
        out.contains(r#""result":{"Success":{"output":"sunny, 21 °C"}}"#),
        "{out}"
    );
    assert!(out.contains("event: run_completed"), "{out}");
    assert!(
        out.contains(
            r#"`get_location` answered {\"city\":\"Paris\"}. `get_weather` answered sunny, 21 °C."#
        ),
        "{out}"
    );

    let out = run(&block("### Approvals", 0), &host).await;
    assert!(out.contains(r#""kind":"approval""#), "{out}");
    assert!(
        out.contains(r#""result":{"Failure":{"error":"rejected by the user: not now"}}"#),
        "{out}"
    );
    assert!(
        out.contains(r#""type":"tool_approval_decided","call_id":"call_1","tool_name":"current_time","approved":false,"reason":"not now","decided_by":"alice"}"#),
        "{out}"
    );

    let out = run(&block("### Sessions", 0), &host).await;
    assert!(
        out.contains(r#""title":"Demo","metadata":{},"defaults":{"provider":"demo","model":"demo","instructions":"Be kind."}"#),
        "{out}"
    );
}

#[tokio::test]
async fn the_preset_example_runs_with_examples_agents_toml() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("behest.db").display());
    let server =
        ServerProcess::start("agents", include_str!("../../examples/agents.toml"), &db).await;
    let host = server.addr.to_string();
    let script = format!(
        "{}\n{}",
        block("### Agent presets", 0),
        block("### Agent presets", 1)
    );
    let out = run(&script, &host).await;
    assert!(out.contains(r#"{"agents":[{"name":"concierge""#), "{out}");
    assert!(
        out.contains(
            "(My instructions: “You are a polite hotel concierge. Answer in one sentence.”.) Hello!"
        ),
        "{out}"
    );
    // The session's next run needed only its input, and the walkthrough answers the
    // concierge's client tool: the run completed with the output, nothing is left waiting.
    assert!(out.contains("`get_room` answered Room 214"), "{out}");
    assert!(out.contains(r#""status":"completed""#), "{out}");
    let waiting = server.get_json("/runs?status=requires_action").await;
    assert_eq!(waiting["runs"], serde_json::json!([]), "{waiting}");
}

#[tokio::test]
async fn the_structured_output_and_image_examples_run_against_the_demo() {
    let server = DemoServer::start().await;
    let host = server.url.trim_start_matches("http://").to_owned();

    let out = run(&block("### Structured output", 0), &host).await;
    assert!(
        out.contains(r#""type":"run_completed","finish_reason":"stop","iterations":1,"parsed":{"budget":"low","city":"x","days":2}"#),
        "{out}"
    );
    assert!(
        out.contains(r#""error_class":null,"parsed":{"budget":"low","city":"x","days":2}}"#),
        "{out}"
    );
    assert!(
        out.contains(r#""code":"invalid_field","field":"output_schema""#),
        "{out}"
    );

    let out = run(&block("### Images in the input", 0), &host).await;
    assert!(
        out.contains(r#""role":"user","content":[{"type":"text","text":"What is in this picture?"},{"type":"image","url":"data:image/png;base64,iVBORw0KGgo"#),
        "{out}"
    );
    assert!(out.contains(r#""media_type":"image/png"}]"#), "{out}");
    assert!(out.contains(r#""role":"assistant""#), "{out}");
}

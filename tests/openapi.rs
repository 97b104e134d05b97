//! `openapi/openapi.json` is generated from the code: this fails when they drift.
//! Regenerate with `cargo run -- openapi > openapi/openapi.json`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests"
)]

use serde_json::Value;

#[test]
fn checked_in_spec_matches_the_code() {
    let generated = behest::api::openapi().to_pretty_json().unwrap() + "\n";
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json");
    let checked_in = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        generated == checked_in,
        "openapi/openapi.json is stale: run `cargo run -- openapi > openapi/openapi.json`"
    );
}

#[test]
fn event_schema_is_a_discriminated_one_of_of_named_variants() {
    let spec: Value = serde_json::to_value(behest::api::openapi()).unwrap();
    let schemas = &spec["components"]["schemas"];
    let event = &schemas["AgentEvent"];
    let variants = event["oneOf"].as_array().unwrap();
    assert_eq!(
        variants.len(),
        23,
        "one component per AgentEvent variant (the seed's 18, reasoning_delta, model_retrying, \
         run_resumed, tool_calls_required, context_compacted)"
    );
    assert_eq!(event["discriminator"]["propertyName"], "type");
    let mapping = event["discriminator"]["mapping"].as_object().unwrap();
    assert_eq!(mapping.len(), 23);
    for (tag, reference) in mapping {
        let name = reference
            .as_str()
            .unwrap()
            .trim_start_matches("#/components/schemas/");
        let component = &schemas[name];
        assert_eq!(
            component["properties"]["type"]["enum"],
            serde_json::json!([tag]),
            "{name}"
        );
        for field in [
            "sequence",
            "run_id",
            "timestamp",
            "trace_id",
            "span_id",
            "type",
        ] {
            assert!(
                component["required"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|r| r == field),
                "{name} requires {field}"
            );
        }
    }
    assert!(mapping.contains_key("cache_metrics"));
    // The tool result's variants are named components too.
    for name in ["ToolExecutionResult", "ToolSuccess", "ToolFailure"] {
        assert!(schemas.get(name).is_some(), "{name} is a component");
    }
}

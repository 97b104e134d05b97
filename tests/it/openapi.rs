//! `openapi/openapi.json` is generated from the code: this fails when they drift.
//! Regenerate with `cargo run -- openapi > openapi/openapi.json`.

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
        27,
        "one component per AgentEvent variant (the seed's 18, reasoning_delta, model_retrying, \
         run_resumed, tool_calls_required, context_compacted, context_compaction_started, \
         output_rejected, tool_progress, tool_approval_decided)"
    );
    assert_eq!(event["discriminator"]["propertyName"], "type");
    let mapping = event["discriminator"]["mapping"].as_object().unwrap();
    assert_eq!(mapping.len(), 27);
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

/// Whether `schema` says what it is: a description of its own, or (a bare `$ref`, or a
/// nullable `oneOf` of one) the description of the component it names.
fn described(spec: &Value, schema: &Value) -> bool {
    let own = schema["description"]
        .as_str()
        .is_some_and(|d| !d.trim().is_empty());
    if own {
        return true;
    }
    let reference = schema["$ref"].as_str().or_else(|| {
        schema["oneOf"]
            .as_array()
            .and_then(|variants| variants.iter().find_map(|v| v["$ref"].as_str()))
    });
    reference.is_some_and(|reference| {
        let name = reference.trim_start_matches("#/components/schemas/");
        described(spec, &spec["components"]["schemas"][name])
    })
}

#[test]
fn every_operation_parameter_and_schema_is_described() {
    let spec: Value = serde_json::to_value(behest::api::openapi()).unwrap();
    let mut missing = Vec::new();
    let text = |value: &Value| value.as_str().is_some_and(|t| !t.trim().is_empty());
    for (path, item) in spec["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let at = format!("{method} {path}");
            if !text(&operation["summary"]) {
                missing.push(format!("{at}: summary"));
            }
            if !text(&operation["description"]) {
                missing.push(format!("{at}: description"));
            }
            for parameter in operation["parameters"].as_array().into_iter().flatten() {
                if !text(&parameter["description"]) {
                    missing.push(format!("{at}: parameter {}", parameter["name"]));
                }
            }
            if operation.get("requestBody").is_some()
                && !text(&operation["requestBody"]["description"])
            {
                missing.push(format!("{at}: request body"));
            }
            for (status, response) in operation["responses"].as_object().unwrap() {
                if !text(&response["description"]) {
                    missing.push(format!("{at}: response {status}"));
                }
            }
        }
    }
    let schemas = spec["components"]["schemas"].as_object().unwrap();
    for (name, schema) in schemas {
        if !text(&schema["description"]) {
            missing.push(format!("schema {name}"));
        }
        for (field, property) in schema["properties"].as_object().into_iter().flatten() {
            if !described(&spec, property) {
                missing.push(format!("schema {name}: property {field}"));
            }
        }
    }
    // Each variant of the event union is a described component (checked above), and so is
    // every security scheme.
    for (name, scheme) in spec["components"]["securitySchemes"].as_object().unwrap() {
        if !text(&scheme["description"]) {
            missing.push(format!("security scheme {name}"));
        }
    }
    assert!(missing.is_empty(), "undescribed:\n{}", missing.join("\n"));
}

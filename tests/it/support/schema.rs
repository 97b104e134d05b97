//! Validates emitted events against the `AgentEvent` schema of the OpenAPI document.

use serde_json::{Value, json};

/// A validator for one `AgentEvent` (the spec's components resolve against the document root).
pub struct EventSchema(jsonschema::Validator);

impl EventSchema {
    pub fn new() -> Self {
        let spec = serde_json::to_value(behest::api::openapi()).expect("spec JSON");
        let schema = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$ref": "#/components/schemas/AgentEvent",
            "components": spec["components"],
        });
        Self(jsonschema::validator_for(&schema).expect("valid schema"))
    }

    /// Panics with every violation when `event` does not match.
    pub fn check(&self, event: &Value) {
        let errors: Vec<String> = self.0.iter_errors(event).map(|e| e.to_string()).collect();
        assert!(
            errors.is_empty(),
            "event {event} violates the schema: {errors:?}"
        );
    }
}

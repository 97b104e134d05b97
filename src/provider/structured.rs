//! Structured output on the wire: the JSON Schema a run's final answer must match, in each
//! wire format's own form — OpenAI-compatible `response_format`
//! (`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`), Anthropic
//! `output_config` (`{"format": {"type": "json_schema", "schema"}}`, generally available on the
//! Claude API; the beta `output_format` is not used) — whether a schema qualifies for OpenAI's
//! strict mode, and the minimal instance the built-in model answers with.

use serde_json::{Map, Value, json};

/// The `json_schema.name` sent to OpenAI-compatible servers (`^[a-zA-Z0-9_-]{1,64}$`).
pub const SCHEMA_NAME: &str = "output";

/// The request-body key that carries the schema, per wire format: OpenAI-compatible
/// `response_format`, Anthropic `output_config`. A run with an `output_schema` may not set it
/// in `provider_options` too.
pub const OPENAI_KEY: &str = "response_format";
/// See [`OPENAI_KEY`].
pub const ANTHROPIC_KEY: &str = "output_config";

/// What a model call's answer must match.
#[derive(Debug, Clone, PartialEq)]
pub struct StructuredOutput {
    /// The JSON Schema (an object).
    pub schema: Value,
    /// Whether it qualifies for OpenAI's strict mode ([`qualifies_for_strict`]).
    pub strict: bool,
}

impl StructuredOutput {
    /// `schema`, strict when it qualifies.
    #[must_use]
    pub fn new(schema: Value) -> Self {
        Self {
            strict: qualifies_for_strict(&schema),
            schema,
        }
    }

    /// The OpenAI-compatible `response_format` value.
    #[must_use]
    pub fn openai(&self) -> Value {
        json!({
            "type": "json_schema",
            "json_schema": {"name": SCHEMA_NAME, "schema": self.schema, "strict": self.strict},
        })
    }

    /// The Anthropic `output_config` value.
    #[must_use]
    pub fn anthropic(&self) -> Value {
        json!({"format": {"type": "json_schema", "schema": self.schema}})
    }
}

/// Keywords OpenAI's strict mode does not support (its "supported schemas" list); a schema
/// using one is sent with `strict: false`.
const UNSUPPORTED_IN_STRICT: &[&str] = &[
    "patternProperties",
    "unevaluatedProperties",
    "propertyNames",
    "dependentSchemas",
    "dependentRequired",
    "if",
    "then",
    "else",
    "not",
    "contains",
    "unevaluatedItems",
    "allOf",
    "oneOf",
];

/// Whether `schema` qualifies for OpenAI's strict mode: its root is an object schema, every
/// object schema in it lists all its `properties` in `required` and has
/// `"additionalProperties": false`, and it uses none of the keywords strict mode refuses
/// (`allOf`, `oneOf`, `not`, `if`/`then`/`else`, `patternProperties`, …). Strict mode makes
/// the server constrain decoding to the schema; without it the answer is still validated here.
#[must_use]
pub fn qualifies_for_strict(schema: &Value) -> bool {
    let Some(root) = schema.as_object() else {
        return false;
    };
    is_object_schema(root) && strict_node(schema)
}

fn is_object_schema(node: &Map<String, Value>) -> bool {
    node.get("type") == Some(&json!("object")) || node.contains_key("properties")
}

fn strict_node(node: &Value) -> bool {
    let Some(object) = node.as_object() else {
        // `true`/`false` subschemas are not in strict mode's subset.
        return false;
    };
    if UNSUPPORTED_IN_STRICT
        .iter()
        .any(|keyword| object.contains_key(*keyword))
    {
        return false;
    }
    if is_object_schema(object) {
        if object.get("additionalProperties") != Some(&Value::Bool(false)) {
            return false;
        }
        let properties = object.get("properties").and_then(Value::as_object);
        let required: Vec<&str> = object
            .get("required")
            .and_then(Value::as_array)
            .map(|names| names.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if let Some(properties) = properties {
            if !properties
                .keys()
                .all(|key| required.contains(&key.as_str()))
            {
                return false;
            }
            if !properties.values().all(strict_node) {
                return false;
            }
        }
    }
    let nested = ["items", "additionalProperties"]
        .iter()
        .filter_map(|key| object.get(*key))
        .filter(|value| value.is_object())
        .all(strict_node);
    let listed = ["anyOf", "prefixItems"]
        .iter()
        .filter_map(|key| object.get(*key).and_then(Value::as_array))
        .flatten()
        .all(strict_node);
    let defined = ["$defs", "definitions"]
        .iter()
        .filter_map(|key| object.get(*key).and_then(Value::as_object))
        .flat_map(Map::values)
        .all(strict_node);
    nested && listed && defined
}

/// Most levels [`minimal_instance`] descends before it gives up (a recursive schema).
const MAX_DEPTH: usize = 32;

/// The smallest value that plausibly matches `schema`, built from its keywords: `const`, the
/// first of `enum`, `default`; by `type`: an object with each `required` property's minimal
/// value, an array of `minItems` minimal items, a string of `minLength` `x`s, a number at its
/// `minimum` (or 0), `false`, `null`; the first of `anyOf`/`oneOf`, the merge of `allOf`;
/// local `$ref`s (`#/…`) are followed. Not every schema's instance is found this way (a
/// `pattern`, `not`, …): the caller validates it. This is what the built-in model answers a
/// run with an `output_schema`.
#[must_use]
pub fn minimal_instance(schema: &Value) -> Value {
    instance(schema, schema, 0)
}

fn instance(root: &Value, node: &Value, depth: usize) -> Value {
    let Some(object) = node.as_object() else {
        return Value::Null;
    };
    if depth > MAX_DEPTH {
        return Value::Null;
    }
    if let Some(value) = object.get("const") {
        return value.clone();
    }
    if let Some(first) = object
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|v| v.first())
    {
        return first.clone();
    }
    if let Some(value) = object.get("default") {
        return value.clone();
    }
    if let Some(target) = object
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|reference| reference.strip_prefix('#'))
        .and_then(|pointer| root.pointer(pointer))
    {
        return instance(root, target, depth + 1);
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(first) = object
            .get(key)
            .and_then(Value::as_array)
            .and_then(|v| v.first())
        {
            return instance(root, first, depth + 1);
        }
    }
    if let Some(all) = object.get("allOf").and_then(Value::as_array) {
        let mut merged = Map::new();
        for part in all {
            match instance(root, part, depth + 1) {
                Value::Object(fields) => merged.extend(fields),
                other if merged.is_empty() => return other,
                _ => {}
            }
        }
        return Value::Object(merged);
    }
    let kind = match object.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        Some(Value::Array(kinds)) => kinds.first().and_then(Value::as_str).unwrap_or("null"),
        _ if object.contains_key("properties") => "object",
        _ if object.contains_key("items") => "array",
        _ => "null",
    };
    let count = |key: &str| {
        object
            .get(key)
            .and_then(Value::as_u64)
            .map_or(0, |n| usize::try_from(n.min(64)).unwrap_or(0))
    };
    match kind {
        "object" => {
            let properties = object.get("properties").and_then(Value::as_object);
            let mut fields = Map::new();
            for name in object
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
            {
                let property = properties.and_then(|p| p.get(name)).unwrap_or(&Value::Null);
                fields.insert(name.to_owned(), instance(root, property, depth + 1));
            }
            Value::Object(fields)
        }
        "array" => {
            let item = object
                .get("items")
                .map_or(Value::Null, |items| instance(root, items, depth + 1));
            Value::Array(vec![item; count("minItems")])
        }
        "string" => Value::String("x".repeat(count("minLength"))),
        "integer" | "number" => {
            let minimum = object
                .get("minimum")
                .cloned()
                .or_else(|| {
                    object
                        .get("exclusiveMinimum")
                        .and_then(Value::as_f64)
                        .map(|m| json!(m.floor() + 1.0))
                })
                .unwrap_or(json!(0));
            if kind == "integer" {
                minimum
                    .as_f64()
                    .map_or(json!(0), |m| json!(m.ceil() as i64))
            } else {
                minimum
            }
        }
        "boolean" => Value::Bool(false),
        _ => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_needs_closed_objects_with_every_property_required() {
        let closed = json!({
            "type": "object",
            "properties": {"city": {"type": "string"}, "tags": {"type": "array", "items": {
                "type": "object", "properties": {"k": {"type": "string"}},
                "required": ["k"], "additionalProperties": false}}},
            "required": ["city", "tags"],
            "additionalProperties": false,
        });
        assert!(qualifies_for_strict(&closed));
        let mut open = closed.clone();
        open["additionalProperties"] = json!(true);
        assert!(!qualifies_for_strict(&open));
        let mut optional = closed.clone();
        optional["required"] = json!(["city"]);
        assert!(!qualifies_for_strict(&optional));
        let mut nested_open = closed.clone();
        nested_open["properties"]["tags"]["items"]
            .as_object_mut()
            .unwrap()
            .remove("additionalProperties");
        assert!(!qualifies_for_strict(&nested_open));
        let mut with_not = closed;
        with_not["properties"]["city"] = json!({"not": {"type": "null"}});
        assert!(!qualifies_for_strict(&with_not));
        assert!(!qualifies_for_strict(&json!({"type": "string"})));
    }

    #[test]
    fn minimal_instances_validate() {
        let schemas = [
            json!({"type": "object", "properties": {
                "city": {"type": "string", "minLength": 2},
                "temperature_c": {"type": "number", "minimum": -90},
                "days": {"type": "integer", "exclusiveMinimum": 0},
                "unit": {"enum": ["c", "f"]},
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "sunny": {"type": "boolean"},
                "note": {"type": ["string", "null"]},
                "where": {"$ref": "#/$defs/place"},
            }, "required": ["city", "temperature_c", "days", "unit", "tags", "sunny", "note", "where"],
               "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "number"}},
                                   "required": ["lat"]}}}),
            json!({"type": "array", "items": {"const": 7}, "minItems": 2}),
            json!({"anyOf": [{"type": "integer", "minimum": 3}, {"type": "string"}]}),
            json!({"allOf": [{"type": "object", "properties": {"a": {"type": "string"}},
                               "required": ["a"]},
                              {"type": "object", "properties": {"b": {"type": "boolean"}},
                               "required": ["b"]}]}),
        ];
        for schema in schemas {
            let value = minimal_instance(&schema);
            let validator = jsonschema::validator_for(&schema).unwrap();
            assert!(
                validator.is_valid(&value),
                "{value} does not match {schema}"
            );
        }
        assert_eq!(
            minimal_instance(
                &json!({"type": "object", "properties": {"city": {"type": "string"}},
                                     "required": ["city"]})
            ),
            json!({"city": ""})
        );
    }
}

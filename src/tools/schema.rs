//! Tool argument schemas (JSON Schema), wherever they come from — a run's client tools, agent
//! presets, MCP servers, HTTP tools: the checks that make a schema safe to validate with, its
//! compilation, and argument validation with bounded output.
//!
//! A schema is refused when it has more than [`MAX_SUBSCHEMAS`] subschemas, when a `$ref`
//! cycle applies it to the same value forever (`{"allOf": [{"$ref": "#"}]}`: no keyword on the
//! way descends into a property or an item), or when one value would be checked against more
//! than [`MAX_APPLIED_PER_VALUE`] subschemas (`allOf`/`anyOf`/`oneOf`/`not`/`if`/`then`/`else`/
//! `dependentSchemas`/`$ref` nested into each other). References are resolved with the
//! `referencing` crate, as `jsonschema` resolves them; nothing is fetched from the network.

use std::collections::{HashMap, HashSet};

use referencing::{Draft, Registry, Resolver, Resource};
use serde_json::Value;

/// Most subschemas a tool's schema may have (every schema object or boolean inside it,
/// `$defs` included).
pub const MAX_SUBSCHEMAS: usize = 10_000;

/// Most subschemas one value of the arguments may be checked against, through in-place
/// applicators and references (each one that applies counts once, however deep).
pub const MAX_APPLIED_PER_VALUE: u64 = 1_000;

/// Most violations reported for one tool call's arguments; more are summarised by a count.
pub const MAX_VIOLATIONS: usize = 20;

/// The base URI a tool schema is resolved against (its `$ref`s without a URI of their own).
const BASE_URI: &str = "urn:behest:tool-schema";

/// Why a schema cannot be used; the message is plain words (no library internals), fit to
/// follow "parameters " in a problem's `detail`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    /// More than [`MAX_SUBSCHEMAS`] subschemas.
    #[error("has more than {MAX_SUBSCHEMAS} subschemas")]
    TooLarge,
    /// A `$ref` cycle that consumes no input; the references on the cycle, in order.
    #[error(
        "has a `$ref` cycle that never descends into the arguments ({0}), so checking a value \
         would never end"
    )]
    Cycle(String),
    /// One value would be checked against more than [`MAX_APPLIED_PER_VALUE`] subschemas.
    #[error(
        "applies more than {MAX_APPLIED_PER_VALUE} subschemas to one value (through nested \
         allOf/anyOf/oneOf/not/if/then/else/$ref)"
    )]
    TooManyApplied,
    /// A `$ref` that names nothing in the schema (remote references are not fetched).
    #[error("has a `$ref` that does not resolve: `{0}`")]
    Unresolvable(String),
    /// Not a JSON Schema `jsonschema` compiles; the reason in its words.
    #[error("is not a valid JSON Schema: {0}")]
    Invalid(String),
}

/// A tool's compiled argument schema, or why it cannot be used: then every call's arguments
/// are refused with that reason (a schema from an MCP server or a stored run that passes no
/// longer is never validated with). A deferred one ([`ToolSchema::deferred`]) is compiled at
/// its first use.
pub struct ToolSchema {
    compiled: std::sync::OnceLock<Result<jsonschema::Validator, SchemaError>>,
    /// The schema of a deferred one, until it is compiled.
    source: Option<Value>,
}

impl std::fmt::Debug for ToolSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.compiled.get() {
            Some(Ok(_)) => f.write_str("ToolSchema(compiled)"),
            Some(Err(error)) => write!(f, "ToolSchema(unusable: {error})"),
            None => f.write_str("ToolSchema(deferred)"),
        }
    }
}

impl ToolSchema {
    /// Checks (see [`check`]) and compiles `schema`; a schema that fails is kept as its error.
    #[must_use]
    pub fn new(schema: &Value) -> Self {
        Self {
            compiled: std::sync::OnceLock::from(compile(schema)),
            source: None,
        }
    }

    /// A schema compiled at its first [`ToolSchema::validate`], for the built-in tools' own
    /// schemas (known good, a test compiles each): compiling any schema makes `jsonschema`
    /// build its validator of the JSON Schema meta-schema once, about 3 MiB kept for the
    /// process's life, which an idle server need not hold.
    #[must_use]
    pub fn deferred(schema: Value) -> Self {
        Self {
            compiled: std::sync::OnceLock::new(),
            source: Some(schema),
        }
    }

    fn compiled(&self) -> &Result<jsonschema::Validator, SchemaError> {
        self.compiled.get_or_init(|| match &self.source {
            Some(schema) => compile(schema),
            None => Err(SchemaError::Invalid("no schema".to_owned())),
        })
    }

    /// Why the schema cannot be used, if it cannot (compiles a deferred one).
    #[must_use]
    pub fn error(&self) -> Option<&SchemaError> {
        self.compiled().as_ref().err()
    }

    /// Validates `arguments`: `Ok`, or up to [`MAX_VIOLATIONS`] violations in words, each with
    /// its JSON pointer, joined by `; ` (a schema that cannot be used: that reason).
    ///
    /// # Errors
    /// The violations, or the schema's problem, as one readable string.
    pub fn validate(&self, arguments: &Value) -> Result<(), String> {
        self.violations(arguments).map_err(|violations| {
            violations
                .into_iter()
                .map(|(path, message)| {
                    if path.is_empty() {
                        message
                    } else {
                        format!("{path}: {message}")
                    }
                })
                .collect::<Vec<_>>()
                .join("; ")
        })
    }

    /// Validates `value`: `Ok`, or up to [`MAX_VIOLATIONS`] violations as `(JSON pointer,
    /// message)` (the `jsonschema` crate's instance path, `""` for the whole value), then
    /// `("", "and N more")` when there were more; a schema that cannot be used: `("", that
    /// reason)`.
    ///
    /// # Errors
    /// The violations.
    pub fn violations(&self, value: &Value) -> Result<(), Vec<(String, String)>> {
        let validator = match self.compiled() {
            Ok(validator) => validator,
            Err(error) => {
                return Err(vec![(
                    String::new(),
                    format!("the tool's parameters schema {error}"),
                )]);
            }
        };
        let mut violations = Vec::new();
        let mut more = 0usize;
        for error in validator.iter_errors(value) {
            if violations.len() == MAX_VIOLATIONS {
                more += 1;
                continue;
            }
            violations.push((error.instance_path.to_string(), error.to_string()));
        }
        if violations.is_empty() {
            return Ok(());
        }
        if more > 0 {
            violations.push((String::new(), format!("and {more} more")));
        }
        Err(violations)
    }
}

/// Checks `schema` (see [`check`]), then compiles it.
///
/// # Errors
/// [`SchemaError`], the compile error in words.
pub fn compile(schema: &Value) -> Result<jsonschema::Validator, SchemaError> {
    check(schema)?;
    jsonschema::validator_for(schema).map_err(|error| SchemaError::Invalid(error.to_string()))
}

/// Checks that validating with `schema` is bounded: at most [`MAX_SUBSCHEMAS`] subschemas,
/// no `$ref` cycle that consumes no input, at most [`MAX_APPLIED_PER_VALUE`] subschemas applied
/// to one value, every reference resolving inside the schema. It does not compile the schema.
///
/// # Errors
/// The first [`SchemaError`] found.
pub fn check(schema: &Value) -> Result<(), SchemaError> {
    let resource =
        Resource::from_contents(schema.clone()).map_err(|e| SchemaError::Invalid(plain(&e)))?;
    let draft = resource.draft();
    let registry =
        Registry::try_new(BASE_URI, resource).map_err(|e| SchemaError::Invalid(plain(&e)))?;
    let resolver = registry
        .try_resolver(BASE_URI)
        .map_err(|e| SchemaError::Invalid(plain(&e)))?;
    let root = resolver
        .lookup("#")
        .map_err(|e| SchemaError::Invalid(plain(&e)))?;
    let (contents, resolver, _) = root.into_inner();
    let nodes = subschemas(Node {
        value: contents,
        resolver,
        draft,
    })?;
    let mut walk = Walk::default();
    for node in nodes {
        walk.applied(node)?;
    }
    Ok(())
}

/// A subschema with the resolver of its scope.
#[derive(Clone)]
struct Node<'r> {
    value: &'r Value,
    resolver: Resolver<'r>,
    draft: Draft,
}

impl<'r> Node<'r> {
    /// Its identity: where it lives in the registry (each subschema once).
    fn key(&self) -> *const Value {
        self.value
    }

    /// A subschema of this one, in its own scope (its `$id`, if it has one).
    fn child(&self, value: &'r Value) -> Result<Self, SchemaError> {
        let draft = self.draft.detect(value).unwrap_or(self.draft);
        let resolver = self
            .resolver
            .in_subresource(draft.create_resource_ref(value))
            .map_err(|e| SchemaError::Invalid(plain(&e)))?;
        Ok(Self {
            value,
            resolver,
            draft,
        })
    }

    /// The schemas applied to the same value as this one, each with the reference that led
    /// there (`None` for an applicator keyword).
    fn in_place(&self) -> Result<Vec<(Self, Option<String>)>, SchemaError> {
        let Some(object) = self.value.as_object() else {
            return Ok(Vec::new());
        };
        let mut next = Vec::new();
        for keyword in ["allOf", "anyOf", "oneOf"] {
            for value in object
                .get(keyword)
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                next.push((self.child(value)?, None));
            }
        }
        for keyword in ["not", "if", "then", "else"] {
            if let Some(value) = object.get(keyword) {
                next.push((self.child(value)?, None));
            }
        }
        for keyword in ["dependentSchemas", "dependencies"] {
            let values = object.get(keyword).and_then(Value::as_object);
            for value in values.into_iter().flat_map(|map| map.values()) {
                if value.is_object() || value.is_boolean() {
                    next.push((self.child(value)?, None));
                }
            }
        }
        let mut references = Vec::new();
        for keyword in ["$ref", "$dynamicRef"] {
            if let Some(reference) = object.get(keyword).and_then(Value::as_str) {
                references.push((reference.to_owned(), self.resolver.lookup(reference)));
            }
        }
        if object
            .get("$recursiveRef")
            .and_then(Value::as_str)
            .is_some()
        {
            let resolved = self.resolver.lookup_recursive_ref();
            references.push(("$recursiveRef".to_owned(), resolved));
        }
        for (reference, resolved) in references {
            let resolved = resolved.map_err(|_| SchemaError::Unresolvable(reference.clone()))?;
            let (value, resolver, draft) = resolved.into_inner();
            next.push((
                Self {
                    value,
                    resolver,
                    draft,
                },
                Some(reference),
            ));
        }
        Ok(next)
    }
}

/// Every subschema of `root` (itself included), or [`SchemaError::TooLarge`].
fn subschemas(root: Node<'_>) -> Result<Vec<Node<'_>>, SchemaError> {
    let mut found = vec![root];
    let mut at = 0;
    while at < found.len() {
        let node = found[at].clone();
        for value in node.draft.subresources_of(node.value) {
            if found.len() == MAX_SUBSCHEMAS {
                return Err(SchemaError::TooLarge);
            }
            found.push(node.child(value)?);
        }
        at += 1;
    }
    Ok(found)
}

/// The depth-first walk of in-place edges: how many subschemas apply to a value at each
/// subschema, memoised; a subschema met again while its own count is open closes a cycle.
#[derive(Default)]
struct Walk {
    applied: HashMap<*const Value, u64>,
}

/// A subschema whose count is open: its in-place successors and the sum so far.
struct Frame<'r> {
    key: *const Value,
    next: std::vec::IntoIter<(Node<'r>, Option<String>)>,
    /// The reference that led here from the frame below.
    via: Option<String>,
    sum: u64,
}

impl Walk {
    /// How many subschemas apply to a value checked against `node` (itself included).
    fn applied(&mut self, node: Node<'_>) -> Result<u64, SchemaError> {
        if let Some(&count) = self.applied.get(&node.key()) {
            return Ok(count);
        }
        let mut open: HashSet<*const Value> = HashSet::from([node.key()]);
        let mut stack = vec![Frame {
            key: node.key(),
            next: node.in_place()?.into_iter(),
            via: None,
            sum: 1,
        }];
        loop {
            let Some(frame) = stack.last_mut() else {
                return Ok(0);
            };
            let Some((child, via)) = frame.next.next() else {
                let done = stack.pop().map_or(0, |frame| {
                    open.remove(&frame.key);
                    self.applied.insert(frame.key, frame.sum);
                    frame.sum
                });
                match stack.last_mut() {
                    Some(parent) => parent.sum = add(parent.sum, done)?,
                    None => return Ok(done),
                }
                continue;
            };
            if let Some(&count) = self.applied.get(&child.key()) {
                frame.sum = add(frame.sum, count)?;
                continue;
            }
            if open.contains(&child.key()) {
                return Err(SchemaError::Cycle(cycle(&stack, child.key(), via)));
            }
            open.insert(child.key());
            let next = child.in_place()?.into_iter();
            stack.push(Frame {
                key: child.key(),
                next,
                via,
                sum: 1,
            });
        }
    }
}

/// `sum + more`, or [`SchemaError::TooManyApplied`] past the bound.
fn add(sum: u64, more: u64) -> Result<u64, SchemaError> {
    let total = sum.saturating_add(more);
    if total > MAX_APPLIED_PER_VALUE {
        return Err(SchemaError::TooManyApplied);
    }
    Ok(total)
}

/// The references on the cycle that closes at `back` (through `via`), e.g.
/// "`#/$defs/a` → `#/$defs/b` → `#/$defs/a`", or the applicators' words when none is a
/// reference by name.
fn cycle(stack: &[Frame<'_>], back: *const Value, via: Option<String>) -> String {
    let start = stack
        .iter()
        .rposition(|frame| frame.key == back)
        .unwrap_or(0);
    let references: Vec<String> = stack[start + 1..]
        .iter()
        .filter_map(|frame| frame.via.clone())
        .chain(via)
        .map(|reference| format!("`{reference}`"))
        .collect();
    if references.is_empty() {
        "through allOf/anyOf/oneOf/not/if/then/else".to_owned()
    } else {
        references.join(" → ")
    }
}

/// A `referencing` error in words: its message, without the crate's type names.
fn plain(error: &referencing::Error) -> String {
    error.to_string()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn cycles_that_consume_no_input_are_refused() {
        let two = json!({"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}});
        let Err(SchemaError::Cycle(path)) = check(&two) else {
            panic!("accepted {two}");
        };
        assert!(
            path.contains("#/$defs/a") && path.contains("#/$defs/b"),
            "{path}"
        );
        let root = json!({"type": "object", "allOf": [{"$ref": "#"}]});
        assert!(matches!(check(&root), Err(SchemaError::Cycle(_))));
        let not = json!({"$defs": {"a": {"not": {"anyOf": [{"$ref": "#/$defs/a"}]}}}});
        assert!(matches!(check(&not), Err(SchemaError::Cycle(_))));
        let anchored = json!({"$defs": {"a": {"$anchor": "x", "if": {"$ref": "#x"}}}});
        assert!(matches!(check(&anchored), Err(SchemaError::Cycle(_))));
        let draft7 = json!({"$schema": "http://json-schema.org/draft-07/schema#",
                            "definitions": {"a": {"allOf": [{"$ref": "#/definitions/a"}]}}});
        assert!(matches!(check(&draft7), Err(SchemaError::Cycle(_))));
    }

    #[test]
    fn recursion_through_properties_and_items_is_accepted_and_validates() {
        let tree = json!({
            "type": "object",
            "$ref": "#/$defs/node",
            "$defs": {"node": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}
                }
            }}
        });
        let schema = ToolSchema::new(&tree);
        assert!(schema.error().is_none(), "{schema:?}");
        let mut value = json!({"name": "leaf"});
        for depth in 0..50 {
            value = json!({"name": format!("n{depth}"), "children": [value]});
        }
        assert_eq!(schema.validate(&value), Ok(()));
        value["children"][0]["children"][0]["name"] = json!(7);
        let error = schema.validate(&value).unwrap_err();
        assert!(error.contains("/children/0/children/0/name"), "{error}");
    }

    #[test]
    fn size_and_fan_out_are_bounded() {
        let many: serde_json::Map<String, Value> = (0..MAX_SUBSCHEMAS)
            .map(|i| (format!("p{i}"), json!({"type": "string"})))
            .collect();
        let large = json!({"type": "object", "properties": many});
        assert_eq!(check(&large), Err(SchemaError::TooLarge));
        // 2^12 applications per value, without a cycle.
        let mut defs = serde_json::Map::new();
        for level in 0..12 {
            let next = format!("#/$defs/d{}", level + 1);
            defs.insert(
                format!("d{level}"),
                json!({"allOf": [{"$ref": next}, {"$ref": next}]}),
            );
        }
        defs.insert("d12".to_owned(), json!({"type": "object"}));
        let doubling = json!({"$ref": "#/$defs/d0", "$defs": defs});
        assert_eq!(check(&doubling), Err(SchemaError::TooManyApplied));
    }

    #[test]
    fn errors_are_plain_words_and_violations_are_capped() {
        for bad in [
            json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
            json!({"type": "object", "properties": {"a": {"type": "wat"}}}),
            json!({"type": "object", "properties": {"a": {"pattern": "(unclosed"}}}),
        ] {
            let error = compile(&bad)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(!error.is_empty(), "accepted {bad}");
            for internal in ["{ ", "Error", "Some(", "ValidationError", "kind:"] {
                assert!(!error.contains(internal), "{error}");
            }
        }
        let properties: serde_json::Map<String, Value> = (0..50)
            .map(|i| (format!("p{i}"), json!({"type": "string"})))
            .collect();
        let schema = ToolSchema::new(&json!({"type": "object", "properties": properties}));
        let arguments: serde_json::Map<String, Value> =
            (0..50).map(|i| (format!("p{i}"), json!(i))).collect();
        let error = schema.validate(&Value::Object(arguments)).unwrap_err();
        assert_eq!(error.split("; ").count(), MAX_VIOLATIONS + 1, "{error}");
        assert!(error.ends_with("and 30 more"), "{error}");
    }
}

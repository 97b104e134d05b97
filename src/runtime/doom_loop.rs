//! Doom-loop detection: the same tool call (name + canonical JSON arguments, or the raw text of
//! invalid arguments) N times in a row, or a cycle of 2 to 4 calls repeated N times, across the
//! model turns of one run. The calls of one turn are put in a canonical order first, so a batch
//! of parallel calls repeated in another order is the same step; calls of allowed (polled)
//! tools are not counted.

use crate::domain::ToolCall;

/// Canonical JSON text: object keys sorted at every level, no whitespace, so that argument
/// objects that differ only in key order compare equal.
#[must_use]
pub fn canonical_json(value: &serde_json::Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &serde_json::Value, out: &mut String) {
    match value {
        serde_json::Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(&map[key], out);
            }
            out.push('}');
        }
        serde_json::Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// Watches a run's tool calls, in the model's order.
#[derive(Debug)]
pub struct DoomLoopDetector {
    threshold: usize,
    allow: Vec<String>,
    calls: Vec<(String, String)>,
}

impl DoomLoopDetector {
    /// A detector firing at `threshold` repetitions (at least 2).
    #[must_use]
    pub fn new(threshold: u32) -> Self {
        Self {
            threshold: usize::try_from(threshold.max(2)).unwrap_or(usize::MAX),
            allow: Vec::new(),
            calls: Vec::new(),
        }
    }

    /// The same detector ignoring calls of these tools (tools meant to be polled).
    #[must_use]
    pub fn allowing(mut self, tools: &[String]) -> Self {
        self.allow = tools.to_vec();
        self
    }

    /// Records a model turn's calls; returns a description when they complete a doom loop.
    pub fn observe(&mut self, calls: &[ToolCall]) -> Option<String> {
        let mut step: Vec<(String, String)> = calls
            .iter()
            .filter(|call| !self.allow.contains(&call.name))
            .map(|call| {
                let arguments = match &call.invalid_arguments {
                    Some(raw) => format!("invalid arguments: {raw}"),
                    None => canonical_json(&call.arguments),
                };
                (call.name.clone(), arguments)
            })
            .collect();
        step.sort();
        for call in step {
            self.calls.push(call);
            if let Some(description) = self.check() {
                return Some(description);
            }
        }
        None
    }

    fn check(&self) -> Option<String> {
        let n = self.threshold;
        let calls = &self.calls;
        let last = calls.last()?;
        if calls.len() >= n && calls[calls.len() - n..].iter().all(|c| c == last) {
            return Some(format!(
                "the model called `{}` with the same arguments {n} times in a row: {}",
                last.0, last.1
            ));
        }
        for k in 2..=4 {
            if calls.len() < k * n {
                continue;
            }
            let tail = &calls[calls.len() - k * n..];
            let cycle = &tail[..k];
            if cycle.iter().all(|c| c == &cycle[0]) {
                continue;
            }
            if tail.chunks(k).all(|chunk| chunk == cycle) {
                let names: Vec<&str> = cycle.iter().map(|c| c.0.as_str()).collect();
                return Some(format!(
                    "the model repeated a cycle of {k} tool calls ({}) {n} times",
                    names.join(" → ")
                ));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn call(name: &str, arguments: serde_json::Value) -> ToolCall {
        ToolCall {
            invalid_arguments: None,
            id: format!("call_{name}"),
            name: name.to_owned(),
            arguments,
        }
    }

    #[test]
    fn canonical_json_ignores_key_order() {
        assert_eq!(
            canonical_json(&json!({"b": 1, "a": {"y": [1, {"d": 2, "c": 3}], "x": "é"}})),
            r#"{"a":{"x":"é","y":[1,{"c":3,"d":2}]},"b":1}"#
        );
    }

    #[test]
    fn same_call_three_times_in_a_row_key_order_irrelevant() {
        let mut detector = DoomLoopDetector::new(3);
        assert_eq!(
            detector.observe(&[call("get", json!({"a": 1, "b": 2}))]),
            None
        );
        assert_eq!(
            detector.observe(&[call("get", json!({"b": 2, "a": 1}))]),
            None
        );
        let found = detector.observe(&[call("get", json!({"a": 1, "b": 2}))]);
        assert!(found.is_some_and(|d| d.contains("`get`") && d.contains("3 times")));
    }

    #[test]
    fn different_arguments_do_not_trigger() {
        let mut detector = DoomLoopDetector::new(3);
        for page in 0..20 {
            assert_eq!(
                detector.observe(&[call("read", json!({"page": page}))]),
                None
            );
        }
    }

    #[test]
    fn cycles_of_two_to_four_are_detected() {
        for k in 2..=4 {
            let mut detector = DoomLoopDetector::new(3);
            let mut found = None;
            for round in 0..3 {
                for step in 0..k {
                    let description = detector.observe(&[call(&format!("t{step}"), json!({}))]);
                    if description.is_some() {
                        assert_eq!(
                            (round, step),
                            (2, k - 1),
                            "fires on the last call of the third round"
                        );
                        found = description;
                    }
                }
            }
            assert!(
                found.is_some_and(|d| d.contains(&format!("cycle of {k}"))),
                "k = {k}"
            );
        }
    }

    #[test]
    fn allowed_tools_never_trip_the_detector() {
        let mut detector = DoomLoopDetector::new(3).allowing(&["check_status".to_owned()]);
        for _ in 0..10 {
            assert_eq!(
                detector.observe(&[call("check_status", json!({"job": 1}))]),
                None
            );
        }
    }

    #[test]
    fn identical_invalid_arguments_trip_and_different_ones_do_not() {
        let invalid = |raw: &str| ToolCall {
            invalid_arguments: Some(raw.to_owned()),
            ..call("get", json!({}))
        };
        let mut detector = DoomLoopDetector::new(3);
        assert_eq!(detector.observe(&[invalid("{\"a\": 1")]), None);
        assert_eq!(detector.observe(&[invalid("{\"a\": 2")]), None);
        assert_eq!(detector.observe(&[invalid("{\"a\": 3")]), None);
        assert_eq!(detector.observe(&[invalid("{\"a\": 3")]), None);
        let found = detector.observe(&[invalid("{\"a\": 3")]);
        assert!(found.is_some_and(|d| d.contains("invalid arguments")));
    }

    #[test]
    fn a_parallel_batch_repeated_in_another_order_is_the_same_step() {
        let a = call("a", json!({"x": 1}));
        let b = call("b", json!({"y": 2}));
        let mut detector = DoomLoopDetector::new(3);
        assert_eq!(detector.observe(&[a.clone(), b.clone()]), None);
        assert_eq!(detector.observe(&[b.clone(), a.clone()]), None);
        assert!(detector.observe(&[a, b]).is_some());
    }

    #[test]
    fn interrupted_repetition_resets() {
        let mut detector = DoomLoopDetector::new(3);
        let same = call("get", json!({"id": 1}));
        assert_eq!(detector.observe(&[same.clone(), same.clone()]), None);
        assert_eq!(detector.observe(&[call("other", json!({}))]), None);
        assert_eq!(detector.observe(&[same.clone(), same.clone()]), None);
    }
}

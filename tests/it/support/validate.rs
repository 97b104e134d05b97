//! The providers' own validation rules for a request's conversation, as their APIs enforce
//! them (a 400 otherwise): OpenAI Chat Completions and Anthropic Messages. Each returns the
//! list of violations (empty: the provider accepts the history).

use std::collections::HashSet;

use serde_json::Value;

fn non_empty_content(content: &Value) -> bool {
    match content {
        Value::String(text) => !text.is_empty(),
        Value::Array(parts) => !parts.is_empty(),
        _ => false,
    }
}

/// OpenAI Chat Completions: every assistant `tool_calls` entry is answered by exactly one
/// `tool` message right after it (before any other role); no `tool` message without its
/// call; an assistant message has content or tool calls; user content is not empty; call
/// arguments are a JSON object's text.
pub fn validate_openai_request(body: &Value) -> Vec<String> {
    let mut errors = Vec::new();
    let Some(messages) = body["messages"].as_array() else {
        return vec!["`messages` is not an array".to_owned()];
    };
    if messages.is_empty() {
        errors.push("`messages` is empty".to_owned());
    }
    // Calls of the last assistant message not yet answered.
    let mut open: Vec<String> = Vec::new();
    let mut answerable: HashSet<String> = HashSet::new();
    for (i, message) in messages.iter().enumerate() {
        let role = message["role"].as_str().unwrap_or_default();
        if role != "tool" && !open.is_empty() {
            errors.push(format!(
                "messages[{i}] ({role}): tool calls {open:?} have no tool message before it"
            ));
            open.clear();
        }
        if role != "tool" {
            answerable.clear();
        }
        match role {
            "system" | "developer" | "user" => {
                if !non_empty_content(&message["content"]) {
                    errors.push(format!("messages[{i}] ({role}): empty content"));
                }
            }
            "assistant" => {
                let calls = message["tool_calls"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                if message.get("tool_calls").is_some() && calls.is_empty() {
                    errors.push(format!("messages[{i}]: `tool_calls` present but empty"));
                }
                if !non_empty_content(&message["content"]) && calls.is_empty() {
                    errors.push(format!(
                        "messages[{i}]: assistant message with neither content nor tool_calls"
                    ));
                }
                let mut ids = HashSet::new();
                for call in &calls {
                    let id = call["id"].as_str().unwrap_or_default().to_owned();
                    if id.is_empty() || !ids.insert(id.clone()) {
                        errors.push(format!(
                            "messages[{i}]: missing or duplicate call id `{id}`"
                        ));
                    }
                    if call["function"]["name"].as_str().is_none_or(str::is_empty) {
                        errors.push(format!("messages[{i}]: call `{id}` has no name"));
                    }
                    let arguments = call["function"]["arguments"].as_str().unwrap_or("");
                    match serde_json::from_str::<Value>(arguments) {
                        Ok(Value::Object(_)) => {}
                        _ => errors.push(format!(
                            "messages[{i}]: call `{id}` arguments are not a JSON object: {arguments:?}"
                        )),
                    }
                    open.push(id.clone());
                    answerable.insert(id);
                }
            }
            "tool" => {
                let id = message["tool_call_id"].as_str().unwrap_or_default();
                if let Some(position) = open.iter().position(|open_id| open_id == id) {
                    open.remove(position);
                } else if answerable.contains(id) {
                    errors.push(format!("messages[{i}]: call `{id}` answered twice"));
                } else {
                    errors.push(format!(
                        "messages[{i}]: tool message for unknown call `{id}`"
                    ));
                }
                if message["content"].as_str().is_none() && !non_empty_content(&message["content"])
                {
                    errors.push(format!("messages[{i}]: tool message without content"));
                }
            }
            other => errors.push(format!("messages[{i}]: unknown role `{other}`")),
        }
    }
    if !open.is_empty() {
        errors.push(format!(
            "the request ends with unanswered tool calls {open:?}"
        ));
    }
    errors
}

/// Anthropic Messages: roles alternate user/assistant starting with user (the adapter merges
/// consecutive turns of one side); content is not empty and has no empty text block; every
/// `tool_use` is answered by exactly one `tool_result` in the next user turn, and every
/// `tool_result` answers a `tool_use` of the turn just before; `input` is an object; in an
/// assistant turn with `tool_use`, thinking blocks come first; with thinking enabled, the final
/// assistant turn of a tool-use loop starts with a thinking block.
pub fn validate_anthropic_request(body: &Value) -> Vec<String> {
    let mut errors = Vec::new();
    let Some(messages) = body["messages"].as_array() else {
        return vec!["`messages` is not an array".to_owned()];
    };
    if messages.is_empty() {
        errors.push("`messages` is empty".to_owned());
    }
    let mut previous_uses: Vec<String> = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let role = message["role"].as_str().unwrap_or_default();
        let expected = if i % 2 == 0 { "user" } else { "assistant" };
        if role != expected {
            errors.push(format!(
                "messages[{i}]: role `{role}`, expected `{expected}`"
            ));
        }
        let blocks: Vec<Value> = match &message["content"] {
            Value::String(text) => {
                if text.is_empty() {
                    errors.push(format!("messages[{i}]: empty content"));
                }
                vec![serde_json::json!({"type": "text", "text": text})]
            }
            Value::Array(blocks) => {
                if blocks.is_empty() {
                    errors.push(format!("messages[{i}]: empty content"));
                }
                blocks.clone()
            }
            _ => {
                errors.push(format!("messages[{i}]: content missing"));
                Vec::new()
            }
        };
        for block in &blocks {
            if block["type"] == "text" && block["text"].as_str().is_none_or(str::is_empty) {
                errors.push(format!("messages[{i}]: empty text block"));
            }
        }
        match role {
            "user" => {
                let mut answered = HashSet::new();
                for block in blocks.iter().filter(|b| b["type"] == "tool_result") {
                    let id = block["tool_use_id"].as_str().unwrap_or_default().to_owned();
                    if !previous_uses.contains(&id) {
                        errors.push(format!(
                            "messages[{i}]: tool_result for `{id}`, not a tool_use of the previous turn"
                        ));
                    }
                    if !answered.insert(id.clone()) {
                        errors.push(format!("messages[{i}]: `{id}` answered twice"));
                    }
                }
                for id in &previous_uses {
                    if !answered.contains(id) {
                        errors.push(format!("messages[{i}]: tool_use `{id}` has no tool_result"));
                    }
                }
                previous_uses.clear();
            }
            "assistant" => {
                if !previous_uses.is_empty() {
                    errors.push(format!(
                        "messages[{i}]: tool_use {previous_uses:?} not answered before it"
                    ));
                }
                previous_uses.clear();
                let has_tool_use = blocks.iter().any(|b| b["type"] == "tool_use");
                let is_thinking =
                    |b: &Value| b["type"] == "thinking" || b["type"] == "redacted_thinking";
                if has_tool_use {
                    let first_other = blocks.iter().position(|b| !is_thinking(b));
                    let last_thinking = blocks.iter().rposition(is_thinking);
                    if let (Some(other), Some(thinking)) = (first_other, last_thinking)
                        && thinking > other
                    {
                        errors.push(format!("messages[{i}]: thinking block after other content"));
                    }
                }
                for block in blocks.iter().filter(|b| b["type"] == "tool_use") {
                    let id = block["id"].as_str().unwrap_or_default().to_owned();
                    if !block["input"].is_object() {
                        errors.push(format!(
                            "messages[{i}]: tool_use `{id}` input is not an object"
                        ));
                    }
                    if id.is_empty() || previous_uses.contains(&id) {
                        errors.push(format!(
                            "messages[{i}]: missing or duplicate tool_use id `{id}`"
                        ));
                    }
                    previous_uses.push(id);
                }
            }
            _ => {}
        }
    }
    if !previous_uses.is_empty() {
        errors.push(format!(
            "the request ends with unanswered tool_use {previous_uses:?}"
        ));
    }
    // With thinking on, in a tool-use loop (the last user turn only answers tool calls) the
    // final assistant turn must start with a thinking block.
    let thinking_on = body["thinking"]["type"] == "enabled";
    let in_tool_loop = messages.last().is_some_and(|last| {
        last["role"] == "user"
            && last["content"].as_array().is_some_and(|blocks| {
                !blocks.is_empty() && blocks.iter().all(|b| b["type"] == "tool_result")
            })
    });
    if thinking_on && in_tool_loop {
        let first = messages
            .iter()
            .rev()
            .find(|m| m["role"] == "assistant")
            .map(|m| m["content"][0]["type"].clone());
        if !first.is_some_and(|t| t == "thinking" || t == "redacted_thinking") {
            errors.push(
                "thinking is enabled but the final assistant turn does not start with a thinking block"
                    .to_owned(),
            );
        }
    }
    errors
}

//! Messages of a session and their content parts (`common.proto` `Message`, `ContentPart`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{MessageId, RunId, SessionId};

/// Who wrote a message (`common.proto` `Message.role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Instructions for the model.
    System,
    /// The client's input.
    User,
    /// The model's reply.
    Assistant,
    /// The result of one tool call.
    Tool,
}

impl Role {
    /// The snake_case name, as stored and sent.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }

    /// Parses the stored name; `None` for anything else.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "system" => Self::System,
            "user" => Self::User,
            "assistant" => Self::Assistant,
            "tool" => Self::Tool,
            _ => return None,
        })
    }
}

/// One part of a message's content (`common.proto` `ContentPart`), tagged by `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// Plain text.
    Text {
        /// The text, exactly as produced (UTF-8).
        text: String,
    },
    /// A JSON value (for example a tool's structured output).
    Json {
        /// Any JSON value.
        value: serde_json::Value,
    },
    /// An image by reference.
    Image {
        /// Where the image is (https or data URL).
        url: String,
        /// Its media type, e.g. `image/png` — the name a run's input part uses too (rows
        /// stored before it was renamed say `mime_type`, which is still read).
        #[serde(alias = "mime_type")]
        media_type: String,
    },
}

/// A tool call requested by the model (`common.proto` `ToolCall`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCall {
    /// The provider's call id; a tool message answers it with `tool_call_id`.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments as a JSON value (an object for well-formed calls; `{}` when the model's
    /// arguments were not valid JSON, see `invalid_arguments`).
    pub arguments: serde_json::Value,
    /// The model's argument text when it was not valid JSON (truncated, garbled, two objects):
    /// the call is not executed and its result is a `Failure` the model sees. Absent for
    /// well-formed calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invalid_arguments: Option<String>,
}

/// One block of the model's reasoning ("thinking") in an assistant turn, kept so that it can
/// be sent back where the provider requires it: Anthropic extended thinking (`thinking` blocks
/// with their `signature`, `redacted_thinking` blocks with their opaque `data`, replayed first
/// in the assistant turn), DeepSeek-style `reasoning_content`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Reasoning {
    /// The reasoning text as streamed (empty for a redacted block).
    pub text: String,
    /// The provider's signature over the block (Anthropic `signature`), when it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
    /// The encrypted content of a redacted block (Anthropic `redacted_thinking.data`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redacted_data: Option<String>,
}

/// A stored message of a session (`common.proto` `Message`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Message {
    /// Message id (UUID v7).
    pub id: MessageId,
    /// The session it belongs to.
    pub session_id: SessionId,
    /// The run that produced it.
    pub run_id: RunId,
    /// Who wrote it.
    pub role: Role,
    /// Its content parts, in order.
    pub content: Vec<ContentPart>,
    /// Reasoning blocks of an assistant message, in the model's order (they precede its text
    /// and tool calls).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasoning: Vec<Reasoning>,
    /// Tool calls of an assistant message, in the model's order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For a tool message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For a tool message: the tool that produced it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_name: Option<String>,
    /// When it was stored (RFC 3339, UTC).
    pub created_at: DateTime<Utc>,
    /// `incomplete` for the text an assistant streamed in a model call its run ended in (a
    /// cancel, a failure, a server stopped with `recovery = "fail"`), kept so the next turn has
    /// the context; absent for a complete message.
    #[serde(default, skip_serializing_if = "MessageStatus::is_completed")]
    pub status: MessageStatus,
}

/// Whether a message is what its author finished (`completed`, the default) or was cut off
/// (`incomplete`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MessageStatus {
    /// The whole message.
    #[default]
    Completed,
    /// The text an assistant streamed before its run ended early.
    Incomplete,
}

impl MessageStatus {
    /// True for `completed`.
    #[must_use]
    pub fn is_completed(&self) -> bool {
        *self == Self::Completed
    }

    /// The snake_case name, as stored.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Incomplete => "incomplete",
        }
    }

    /// Parses the stored name; `None` for anything else.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "completed" => Some(Self::Completed),
            "incomplete" => Some(Self::Incomplete),
            _ => None,
        }
    }
}

impl Message {
    /// The concatenation of the message's text parts.
    #[must_use]
    pub fn text(&self) -> String {
        self.content
            .iter()
            .filter_map(|part| match part {
                ContentPart::Text { text } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_part_reads_media_type_and_the_old_mime_type() {
        let part = ContentPart::Image {
            url: "https://example.com/cat.png".to_owned(),
            media_type: "image/png".to_owned(),
        };
        let json = serde_json::to_value(&part).ok();
        assert_eq!(
            json,
            Some(
                serde_json::json!({"type": "image", "url": "https://example.com/cat.png",
                                    "media_type": "image/png"})
            )
        );
        // A row stored before the rename.
        let old: Option<ContentPart> = serde_json::from_value(serde_json::json!(
            {"type": "image", "url": "https://example.com/cat.png", "mime_type": "image/png"}
        ))
        .ok();
        assert_eq!(old, Some(part));
    }
}

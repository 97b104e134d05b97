//! A run's `input`: a string, or a list of content parts (text and images), and the user
//! message content it is stored as.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::ContentPart;

/// Most content parts one `input` may have.
pub const MAX_INPUT_PARTS: usize = 64;

/// Most bytes one image's data may take once base64-decoded (3.75 MiB: the 5 MB of base64
/// text Anthropic's Messages API accepts per image); the request body limit
/// (`runtime.max_body_bytes`, default 1 MiB, `413 payload_too_large`) applies first.
pub const MAX_IMAGE_BYTES: usize = 3_932_160;

/// Most bytes an image `url` may have.
pub const MAX_IMAGE_URL_BYTES: usize = 2_048;

/// The image media types every wire format accepts.
pub const IMAGE_MEDIA_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/gif", "image/webp"];

/// A run's `input`: plain text, or content parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum RunInput {
    /// The user's text.
    Text(String),
    /// Text and image parts, in order.
    Parts(Vec<InputPart>),
}

/// One part of a run's `input`, tagged by `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum InputPart {
    /// Text.
    Text {
        /// The text (UTF-8).
        text: String,
    },
    /// An image: its bytes (`media_type` and base64 `data`) or a `url` the provider fetches.
    Image {
        /// `image/png`, `image/jpeg`, `image/gif` or `image/webp`; required with `data`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        media_type: Option<String>,
        /// The image's bytes, base64 (standard alphabet, padded); at most 3932160 bytes
        /// decoded.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<String>,
        /// An `https://` (or `http://`) URL of the image, at most 2048 bytes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        url: Option<String>,
    },
}

impl Default for RunInput {
    fn default() -> Self {
        Self::Text(String::new())
    }
}

impl From<&str> for RunInput {
    fn from(text: &str) -> Self {
        Self::Text(text.to_owned())
    }
}

impl RunInput {
    /// Whether an image part is among the parts.
    #[must_use]
    pub fn has_image(&self) -> bool {
        matches!(self, Self::Parts(parts) if parts.iter().any(|p| matches!(p, InputPart::Image { .. })))
    }

    /// The text parts, joined by a blank line (the whole text of a string input).
    #[must_use]
    pub fn text(&self) -> String {
        match self {
            Self::Text(text) => text.clone(),
            Self::Parts(parts) => parts
                .iter()
                .filter_map(|part| match part {
                    InputPart::Text { text } => Some(text.as_str()),
                    InputPart::Image { .. } => None,
                })
                .collect::<Vec<_>>()
                .join("\n\n"),
        }
    }

    /// The content of the user message the input is stored as: one text part for a string;
    /// each part for parts, an image with `data` as a `data:` URL
    /// (`data:<media_type>;base64,<data>`) and its media type, one with a `url` as that URL
    /// (media type empty: the provider finds it).
    #[must_use]
    pub fn content(&self) -> Vec<ContentPart> {
        match self {
            Self::Text(text) => vec![ContentPart::Text { text: text.clone() }],
            Self::Parts(parts) => parts
                .iter()
                .map(|part| match part {
                    InputPart::Text { text } => ContentPart::Text { text: text.clone() },
                    InputPart::Image {
                        media_type,
                        data,
                        url,
                    } => {
                        let media_type = media_type.clone().unwrap_or_default();
                        let url = match (data, url) {
                            (Some(data), _) => format!("data:{media_type};base64,{data}"),
                            (None, url) => url.clone().unwrap_or_default(),
                        };
                        ContentPart::Image { url, media_type }
                    }
                })
                .collect(),
        }
    }
}

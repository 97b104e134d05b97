//! Images in a run's `input`: the checks that need more than the request itself — each
//! image's base64 decodes to at most [`MAX_IMAGE_BYTES`], and the run's model takes images
//! (a model configured `text_only = true` does not). The parts reach each wire format in its
//! own shape through the stored user message (OpenAI-compatible `image_url` parts, Anthropic
//! `image` blocks with a `base64` or `url` source); compaction counts an image as a fixed
//! estimate (`runtime::tokens`). A session keeps working when it moves to a `text_only` model:
//! the images of its history reach that model as a short text placeholder
//! ([`without_images`]).

use base64::Engine;

use super::CreateRunError;
use crate::config::ModelConfig;
use crate::domain::{ContentPart, InputPart, MAX_IMAGE_BYTES, Message, RunInput};

/// The request's messages for a `text_only` model (`model` names it): each image part of the
/// history is replaced by the text `[image omitted: <model> is text-only]`, so a session whose
/// earlier runs sent images to another model goes on (the stored messages keep their images).
/// A model that takes images gets `messages` as they are.
pub(super) fn without_images(
    mut messages: Vec<Message>,
    text_only: bool,
    model: &str,
) -> Vec<Message> {
    if !text_only {
        return messages;
    }
    for message in &mut messages {
        for part in &mut message.content {
            if matches!(part, ContentPart::Image { .. }) {
                *part = ContentPart::Text {
                    text: format!("[image omitted: {model} is text-only]"),
                };
            }
        }
    }
    messages
}

/// Checks the images of `input` for the run's `model` (`provider`/`model_name` for the
/// message).
///
/// # Errors
/// `invalid_field` naming `input`: data that is not base64, an image over
/// [`MAX_IMAGE_BYTES`], or an image for a `text_only` model.
pub(super) fn check(
    input: &RunInput,
    model: &ModelConfig,
    provider: &str,
    model_name: &str,
) -> Result<(), CreateRunError> {
    let RunInput::Parts(parts) = input else {
        return Ok(());
    };
    let invalid = |reason: String| CreateRunError::InvalidField {
        field: "input",
        reason,
    };
    for (index, part) in parts.iter().enumerate() {
        let InputPart::Image { data, .. } = part else {
            continue;
        };
        if model.text_only {
            return Err(invalid(format!(
                "input[{index}] is an image, but model `{model_name}` of provider `{provider}` \
                 is configured text_only: it takes text only"
            )));
        }
        let Some(data) = data else { continue };
        // The decoded size, known before decoding: refuse a huge image without allocating it.
        if data.len() / 4 * 3 > MAX_IMAGE_BYTES + 2 {
            return Err(invalid(format!(
                "input[{index}].data is over {MAX_IMAGE_BYTES} bytes decoded"
            )));
        }
        match base64::engine::general_purpose::STANDARD.decode(data) {
            Ok(bytes) if bytes.is_empty() => {
                return Err(invalid(format!("input[{index}].data is empty")));
            }
            Ok(bytes) if bytes.len() > MAX_IMAGE_BYTES => {
                return Err(invalid(format!(
                    "input[{index}].data is {} bytes decoded; at most {MAX_IMAGE_BYTES} are \
                     accepted",
                    bytes.len()
                )));
            }
            Ok(_) => {}
            Err(error) => {
                return Err(invalid(format!(
                    "input[{index}].data is not base64 (standard alphabet, padded): {error}"
                )));
            }
        }
    }
    Ok(())
}

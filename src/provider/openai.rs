//! OpenAI Chat Completions, streaming (and compatible servers).

use async_trait::async_trait;

use super::{ErrorClass, ModelRequest, ModelStream, Provider, ProviderError};
use crate::config::ProviderConfig;

/// Adapter for `kind = "openai"`.
#[derive(Debug)]
pub struct OpenAi {
    id: String,
}

impl OpenAi {
    /// Builds the adapter.
    ///
    /// # Errors
    /// When the HTTP client cannot be built.
    pub fn new(id: &str, _config: &ProviderConfig) -> Result<Self, ProviderError> {
        Ok(Self { id: id.to_owned() })
    }
}

#[async_trait]
impl Provider for OpenAi {
    async fn stream(&self, _request: ModelRequest) -> Result<ModelStream, ProviderError> {
        Err(ProviderError::new(
            &self.id,
            ErrorClass::Server,
            "not implemented",
        ))
    }
}

//! Unit tests of the OpenAI adapter.

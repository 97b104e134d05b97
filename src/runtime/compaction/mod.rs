//! Context management: keeps each model request inside the model's context window. A run's
//! context ([`Conversation`]) starts from the session's latest compaction; before each model
//! call its size is estimated (`runtime::tokens`, corrected by the provider's reported usage),
//! and past `context_window − max_output_tokens − buffer_tokens` old tool outputs are pruned
//! (`prune`) and older turns summarised (`select`, `summarise`); a provider's
//! `context_length_exceeded` triggers one compaction and one retry. Consecutive failures open
//! the circuit breaker (counted in the store, across runs and processes), and while it is open
//! nothing is attempted. The settings of `/compaction` live here too.

mod call;
mod conversation;
mod input;
mod job;
mod prune;
mod select;
mod summarise;

use std::time::{Duration, Instant};

use tokio::sync::{Mutex, RwLock};

use super::Runtime;
use crate::domain::{
    CircuitBreaker, Compaction, CompactionConfig, CompactionTrigger, ModelWindow, RunId, SessionId,
    SettingsProblem,
};
use crate::store::{RunFilter, StoreError};
use crate::telemetry;

pub(in crate::runtime) use call::{Call, Stop, Window, record_cut_off_summariser};
pub use conversation::{Conversation, Size};
pub(in crate::runtime) use input::check_input;
pub use summarise::PROMPT as SUMMARISER_PROMPT;

use job::{Attempt, Job};

/// How long a process trusts its copy of the settings when other processes share the store
/// (PostgreSQL): a change through another replica applies within this.
const SETTINGS_REFRESH: Duration = Duration::from_secs(1);

/// The compaction settings of this process: the config file's initial values and the copy of
/// the stored ones.
#[derive(Debug)]
pub(super) struct Settings {
    initial: CompactionConfig,
    current: RwLock<Option<(CompactionConfig, Instant)>>,
    /// Serializes changes (read, merge, check, store).
    writes: Mutex<()>,
}

impl Settings {
    pub(super) fn new(initial: CompactionConfig) -> Self {
        Self {
            initial,
            current: RwLock::new(None),
            writes: Mutex::new(()),
        }
    }
}

/// Why compaction settings were not changed.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A value or combination is invalid (nothing was stored).
    #[error("`{}`: {}", .0.field, .0.reason)]
    Invalid(SettingsProblem),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<SettingsProblem> for SettingsError {
    fn from(problem: SettingsProblem) -> Self {
        Self::Invalid(problem)
    }
}

/// Why `POST /sessions/{id}/compact` did not compact.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    /// No such session.
    #[error("session {0} not found")]
    SessionNotFound(SessionId),
    /// The session has an active run.
    #[error("the session has an active run ({0}); compact it once the run has ended")]
    SessionBusy(RunId),
    /// The circuit breaker is open.
    #[error(
        "the compaction circuit breaker is open after {0} consecutive failures; reset it with \
         POST /compaction/circuit-breaker/reset"
    )]
    CircuitOpen(u32),
    /// Everything fits in what compaction keeps verbatim.
    #[error("nothing to compact: {0}")]
    NothingToCompact(String),
    /// The session's model is no longer configured.
    #[error("{0}")]
    ModelGone(String),
    /// The summariser failed (counted by the circuit breaker).
    #[error("{0}")]
    Failed(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Runtime {
    /// The compaction settings in force: the stored ones (a change through the API), else the
    /// config file's `[compaction]`.
    ///
    /// # Errors
    /// The store's.
    pub async fn compaction_config(&self) -> Result<CompactionConfig, StoreError> {
        if let Some((config, read_at)) = &*self.compaction.current.read().await
            && (self.store.single_process() || read_at.elapsed() < SETTINGS_REFRESH)
        {
            return Ok(config.clone());
        }
        self.reload_compaction_config().await
    }

    async fn reload_compaction_config(&self) -> Result<CompactionConfig, StoreError> {
        let config = self
            .store
            .compaction_config()
            .await?
            .unwrap_or_else(|| self.compaction.initial.clone());
        *self.compaction.current.write().await = Some((config.clone(), Instant::now()));
        Ok(config)
    }

    /// The config file's `[compaction]` settings (what a JSON merge patch's `null` restores).
    #[must_use]
    pub fn initial_compaction_config(&self) -> &CompactionConfig {
        &self.compaction.initial
    }

    /// Changes the compaction settings: `change` turns the current ones into the new ones (or
    /// refuses), which are checked against the configured providers and models, stored, and in
    /// force from the next model call of any run. Changes are applied one at a time; a refused
    /// or invalid change stores nothing.
    ///
    /// # Errors
    /// `change`'s error, or [`SettingsError::Invalid`] naming the field, or the store's.
    pub async fn update_compaction_config<E: From<SettingsError>>(
        &self,
        change: impl FnOnce(CompactionConfig) -> Result<CompactionConfig, E>,
    ) -> Result<CompactionConfig, E> {
        let _one_at_a_time = self.compaction.writes.lock().await;
        let current = self
            .reload_compaction_config()
            .await
            .map_err(|e| E::from(SettingsError::Store(e)))?;
        let next = change(current)?;
        let windows = self.model_windows();
        next.check_values(&windows)
            .and_then(|()| next.check_fit(&windows))
            .map_err(|problem| E::from(SettingsError::Invalid(problem)))?;
        self.store
            .put_compaction_config(&next)
            .await
            .map_err(|e| E::from(SettingsError::Store(e)))?;
        *self.compaction.current.write().await = Some((next.clone(), Instant::now()));
        tracing::info!(settings = ?next, "compaction settings changed");
        Ok(next)
    }

    /// Every configured model with its window.
    fn model_windows(&self) -> Vec<ModelWindow<'_>> {
        self.providers
            .iter()
            .flat_map(|(id, entry)| {
                entry
                    .config
                    .models
                    .iter()
                    .map(move |(name, model)| ModelWindow {
                        provider: id,
                        model: name,
                        context_window: u64::from(model.context_window),
                        max_output_tokens: u64::from(model.max_output_tokens),
                    })
            })
            .collect()
    }

    /// Logs, once at startup, the models whose window the compaction settings do not fit:
    /// their requests are never compacted before the call (only when the provider rejects one).
    pub async fn warn_unfit_models(&self) {
        let Ok(config) = self.compaction_config().await else {
            return;
        };
        for window in self.model_windows() {
            if let Err(problem) = config.check_fit(std::slice::from_ref(&window)) {
                tracing::warn!(
                    provider = window.provider,
                    model = window.model,
                    "compaction settings: {} {}; requests of this model are compacted only when \
                     the provider rejects one as too long",
                    problem.field,
                    problem.reason
                );
            }
        }
    }

    /// The compaction circuit breaker.
    ///
    /// # Errors
    /// The store's.
    pub async fn circuit_breaker(&self) -> Result<CircuitBreaker, StoreError> {
        let threshold = self.compaction_config().await?.circuit_breaker_threshold;
        self.store.circuit_breaker(threshold).await
    }

    /// Closes the circuit breaker and clears its count: compaction is attempted again.
    ///
    /// # Errors
    /// The store's.
    pub async fn reset_circuit_breaker(&self) -> Result<CircuitBreaker, StoreError> {
        let threshold = self.compaction_config().await?.circuit_breaker_threshold;
        tracing::info!("compaction circuit breaker reset");
        self.store.reset_circuit_breaker(threshold).await
    }

    /// Compacts a session now, outside any run (`POST /sessions/{id}/compact`): its context as
    /// the next run would start from it is summarised like an automatic compaction would, with
    /// the model of its latest run (or the configured compaction model), and stored.
    ///
    /// # Errors
    /// [`CompactError`]: a missing or busy session, an open breaker, nothing to compact, a
    /// model no longer configured, the summariser's failure (counted by the breaker), the store.
    pub async fn compact_session(&self, session_id: SessionId) -> Result<Compaction, CompactError> {
        if self.store.get_session(session_id).await?.is_none() {
            return Err(CompactError::SessionNotFound(session_id));
        }
        let latest = self
            .store
            .list_runs(&RunFilter {
                session_id: Some(session_id),
                limit: 1,
                ..RunFilter::default()
            })
            .await?;
        let Some(run) = latest.into_iter().next() else {
            return Err(CompactError::NothingToCompact(
                "the session has no runs".to_owned(),
            ));
        };
        if !run.status.is_terminal() {
            return Err(CompactError::SessionBusy(run.id));
        }
        let settings = self.compaction_config().await?;
        let breaker = self
            .store
            .circuit_breaker(settings.circuit_breaker_threshold)
            .await?;
        if breaker.is_open {
            return Err(CompactError::CircuitOpen(breaker.consecutive_failures));
        }
        let limits = self
            .providers
            .get(&run.provider)
            .and_then(|entry| entry.config.models.get(&run.model).copied())
            .ok_or_else(|| {
                CompactError::ModelGone(format!(
                    "the session's model `{}` of provider `{}` is no longer configured",
                    run.model, run.provider
                ))
            })?;
        let tools = super::agents::tool_specs(self, &run);
        let context = self.store.session_context(session_id).await?;
        let mut conversation =
            Conversation::new(context, &run.model).with_instructions(run.instructions.as_deref());
        let job = Job {
            runtime: self,
            session_id,
            run_id: None,
            provider: &run.provider,
            model: &run.model,
            window: Window::of(limits, super::agents::max_output_tokens(&run, &limits)),
            tools: &tools,
            settings: &settings,
            trigger: CompactionTrigger::Manual,
        };
        match job.run(&mut conversation).await? {
            Attempt::Compacted(candidate) => {
                telemetry::metrics::compaction(CompactionTrigger::Manual.as_str(), true);
                match self.store.insert_compaction(&candidate.compaction).await {
                    Ok(()) => Ok(candidate.compaction),
                    Err(StoreError::SessionBusy { active_run, .. }) => {
                        Err(CompactError::SessionBusy(active_run))
                    }
                    Err(error) => Err(error.into()),
                }
            }
            Attempt::NotAttempted(reason) => Err(CompactError::NothingToCompact(reason)),
            Attempt::Failed { message, .. } => {
                telemetry::metrics::compaction(CompactionTrigger::Manual.as_str(), false);
                self.store
                    .record_compaction_failure(&message, settings.circuit_breaker_threshold)
                    .await?;
                Err(CompactError::Failed(message))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn the_window_gives_the_threshold_and_the_fit() {
        let model = ModelConfig {
            context_window: 8_000,
            max_output_tokens: 1_000,
            text_only: false,
        };
        let window = Window::of(model, 1_000);
        let settings = CompactionConfig {
            buffer_tokens: Some(1_000),
            keep_tokens: Some(2_000),
            ..CompactionConfig::default()
        };
        assert_eq!(window.hard(), 7_000);
        assert_eq!(window.threshold(&settings), 6_000);
        assert!(window.fits(&settings));
        // The seed's absolute values do not fit an 8,000-token window.
        let absolute = CompactionConfig {
            buffer_tokens: Some(20_000),
            keep_tokens: Some(8_000),
            ..CompactionConfig::default()
        };
        assert!(!window.fits(&absolute));
        assert_eq!(window.threshold(&absolute), 0);
    }

    #[test]
    fn unset_buffer_and_keep_are_relative_to_the_window() {
        let defaults = CompactionConfig::default();
        // (context_window, max_output_tokens) → (threshold, keep)
        for (context, output, threshold, keep) in [
            (2_048, 256, 1_792 - 224, 448),
            (8_000, 1_024, 6_976 - 872, 1_744),
            (32_768, 4_096, 28_672 - 3_584, 7_168),
            (128_000, 16_384, 111_616 - 13_952, 8_000),
            (200_000, 8_192, 191_808 - 20_000, 8_000),
        ] {
            let model = ModelConfig {
                context_window: context,
                max_output_tokens: output,
                text_only: false,
            };
            let window = Window::of(model, output);
            assert_eq!(window.threshold(&defaults), threshold, "{context}");
            assert_eq!(window.keep(&defaults), keep, "{context}");
            assert!(window.fits(&defaults), "{context}");
        }
        // One value set, the other relative.
        let buffer_only = CompactionConfig {
            buffer_tokens: Some(6_000),
            ..CompactionConfig::default()
        };
        let small = Window::of(
            ModelConfig {
                context_window: 8_000,
                max_output_tokens: 1_024,
                text_only: false,
            },
            1_024,
        );
        assert_eq!(small.threshold(&buffer_only), 976);
        assert!(
            !small.fits(&buffer_only),
            "keep 1,744 does not fit below 976"
        );
    }
}

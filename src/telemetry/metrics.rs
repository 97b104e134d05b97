//! Prometheus metrics through the `metrics` facade: their names, the recorder (the
//! `metrics-exporter-prometheus` exporter, rendered at `/metrics` through its handle; no
//! listener of its own) and one small function per thing the runtime counts, so each hook in
//! the runtime is one line. Histograms are Prometheus histograms (`_bucket`, `_sum`,
//! `_count`), in seconds or events. Without an installed recorder every function is a no-op.
//!
//! Label values come from the configuration (provider ids, model names, tool names the
//! registry knows) or closed sets (statuses, error classes), never from a client or a model,
//! so the number of series stays bounded.

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// HTTP requests by `method` (`other` outside RFC 9110's), `route` (the route template, e.g. `/runs/{run_id}`, or
/// `unmatched`) and `status`.
pub const HTTP_REQUESTS: &str = "behest_http_requests_total";
/// Time from a request's arrival to its response's head, by `method`, `route`, `status`, in
/// seconds (an event stream counts until its head, not while it streams).
pub const HTTP_DURATION: &str = "behest_http_request_duration_seconds";
/// Runs created by this process.
pub const RUNS_CREATED: &str = "behest_runs_created_total";
/// Runs ended by this process, by terminal `status` (`completed`, `failed`, `cancelled`).
pub const RUNS_FINISHED: &str = "behest_runs_finished_total";
/// Runs executing in this process now.
pub const RUNS_ACTIVE: &str = "behest_runs_active";
/// Time from a run's creation to its terminal event, by terminal `status` (`completed`,
/// `failed`, `cancelled`), in seconds; recorded by the process that ends the run.
pub const RUN_DURATION: &str = "behest_run_duration_seconds";
/// Runs of this process waiting in `requires_action` for tool outputs or approvals now.
pub const RUNS_WAITING: &str = "behest_runs_waiting";
/// Time a run waited in `requires_action`, by `outcome` (`answered`, `cancelled`,
/// `expired`), in seconds (a wait a shutdown interrupts is not recorded: the next process
/// goes on waiting).
pub const RUN_WAIT: &str = "behest_run_wait_seconds";
/// Waits in `requires_action` whose deadline passed without every answer.
pub const RUN_WAITS_EXPIRED: &str = "behest_run_waits_expired_total";
/// 1, labelled with the server's `version`, `os` and `arch`.
pub const BUILD_INFO: &str = "behest_build_info";
/// Event streams (SSE watchers) open now.
pub const SSE_WATCHERS: &str = "behest_sse_watchers";
/// Events written to the store (persisted before they are published).
pub const EVENTS_PERSISTED: &str = "behest_events_persisted_total";
/// Events per group-commit batch of the event log.
pub const EVENT_BATCH_SIZE: &str = "behest_event_log_batch_events";
/// Time one event-log batch takes to commit (retries included), in seconds.
pub const EVENT_COMMIT: &str = "behest_event_log_commit_seconds";
/// Model calls by `provider`, `model` and `outcome` (`ok`, the error class, `cancelled` when a
/// cancel cut the call, `interrupted` when a shutdown or a takeover by another process did).
pub const MODEL_CALLS: &str = "behest_model_calls_total";
/// Time of a whole model call, request to last chunk, by `provider` and `model`, in seconds.
pub const MODEL_DURATION: &str = "behest_model_call_duration_seconds";
/// Time from a model request to its first output (text, reasoning or a tool call), by
/// `provider` and `model`, in seconds.
pub const MODEL_TTFT: &str = "behest_model_time_to_first_token_seconds";
/// Tokens by `provider`, `model` and `kind` (`input`, `output`, `cache_read`,
/// `cache_write`); the tokenizer's estimate when a provider reports none.
pub const MODEL_TOKENS: &str = "behest_model_tokens_total";
/// Retries of model calls by `provider` and `error_class`.
pub const MODEL_RETRIES: &str = "behest_model_retries_total";
/// Tool executions by `tool` and `result` (`success`, `failure`).
pub const TOOL_EXECUTIONS: &str = "behest_tool_executions_total";
/// Time of one tool execution, by `tool`, in seconds.
pub const TOOL_DURATION: &str = "behest_tool_execution_duration_seconds";
/// Doom loops detected (each ends its run).
pub const DOOM_LOOPS: &str = "behest_doom_loops_total";
/// Compactions attempted by `trigger` (`auto`, `reactive`, `manual`) and `outcome`
/// (`compacted`, `failed`: an error, an empty summary, one that did not shrink the request).
pub const COMPACTIONS: &str = "behest_compactions_total";
/// 1 while the compaction circuit breaker is open, else 0 (the store's state, read at each
/// scrape: shared by every process on the database).
pub const BREAKER_OPEN: &str = "behest_compaction_circuit_open";
/// Consecutive failed compactions the circuit breaker has counted (read at each scrape).
pub const BREAKER_FAILURES: &str = "behest_compaction_consecutive_failures";

/// Webhook delivery attempts by `outcome` (`delivered`, `retry`: failed and scheduled again,
/// `failed`: the schedule's last attempt failed, `interrupted`: cut short by a shutdown or a
/// process's death, counted by the process that releases or finds it).
pub const WEBHOOK_DELIVERIES: &str = "behest_webhook_deliveries_total";
/// Webhook deliveries pending in the outbox (of every process on the database), as this
/// process's delivery worker last read it.
pub const WEBHOOKS_PENDING: &str = "behest_webhook_deliveries_pending";

/// Bucket bounds of the histograms in seconds: 1 ms to 5 min.
const SECONDS_BUCKETS: [f64; 17] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];
/// Bucket bounds of the event-log batch size.
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
/// How often histograms are folded into their buckets between scrapes.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
/// The `process_*` collector (`metrics-process`), read at each scrape.
static PROCESS: OnceLock<metrics_process::Collector> = OnceLock::new();

/// The process's Prometheus recorder, installed as the global `metrics` recorder on the first
/// call; `None` when another recorder was installed first (then nothing is rendered).
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let built = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), &SECONDS_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(EVENT_BATCH_SIZE.to_owned()),
                        &BATCH_BUCKETS,
                    )
                })
                .and_then(PrometheusBuilder::install_recorder);
            match built {
                Ok(handle) => {
                    describe();
                    PROCESS
                        .get_or_init(metrics_process::Collector::default)
                        .describe();
                    ::metrics::gauge!(
                        BUILD_INFO,
                        "version" => env!("CARGO_PKG_VERSION"),
                        "os" => std::env::consts::OS,
                        "arch" => std::env::consts::ARCH
                    )
                    .set(1.0);
                    let upkeep = handle.clone();
                    let spawned = std::thread::Builder::new()
                        .name("metrics-upkeep".to_owned())
                        .spawn(move || {
                            loop {
                                std::thread::sleep(UPKEEP_INTERVAL);
                                upkeep.run_upkeep();
                            }
                        });
                    if let Err(error) = spawned {
                        tracing::warn!(%error, "no metrics upkeep thread; scrapes still render");
                    }
                    Some(handle)
                }
                Err(error) => {
                    tracing::warn!(%error, "metrics recorder not installed");
                    None
                }
            }
        })
        .clone()
}

/// The `# HELP` lines.
fn describe() {
    use ::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        HTTP_REQUESTS,
        "HTTP requests by method, route template and status"
    );
    describe_histogram!(
        HTTP_DURATION,
        Unit::Seconds,
        "Request arrival to response head, by method, route template and status"
    );
    describe_counter!(RUNS_CREATED, "Runs created");
    describe_counter!(
        RUNS_FINISHED,
        "Runs ended, by terminal status (and error class, for failed runs)"
    );
    describe_gauge!(RUNS_ACTIVE, "Runs executing in this process");
    describe_histogram!(
        RUN_DURATION,
        Unit::Seconds,
        "Run creation to its terminal event, by terminal status"
    );
    describe_gauge!(
        RUNS_WAITING,
        "Runs of this process waiting in requires_action for tool outputs or approvals"
    );
    describe_histogram!(
        RUN_WAIT,
        Unit::Seconds,
        "Time a run waited in requires_action, by outcome (answered, cancelled, expired)"
    );
    describe_counter!(
        RUN_WAITS_EXPIRED,
        "Waits in requires_action whose deadline passed"
    );
    describe_gauge!(
        BUILD_INFO,
        "1, labelled with the server's version, os and arch"
    );
    describe_gauge!(SSE_WATCHERS, "Event streams (SSE watchers) open");
    describe_counter!(EVENTS_PERSISTED, "Events written to the store");
    describe_histogram!(EVENT_BATCH_SIZE, "Events per event-log group commit");
    describe_histogram!(
        EVENT_COMMIT,
        Unit::Seconds,
        "Commit time of one event-log batch"
    );
    describe_counter!(MODEL_CALLS, "Model calls by provider, model and outcome");
    describe_histogram!(
        MODEL_DURATION,
        Unit::Seconds,
        "Model call, request to last chunk"
    );
    describe_histogram!(
        MODEL_TTFT,
        Unit::Seconds,
        "Model request to its first output"
    );
    describe_counter!(MODEL_TOKENS, "Tokens by provider, model and kind");
    describe_counter!(
        MODEL_RETRIES,
        "Model call retries by provider and error class"
    );
    describe_counter!(TOOL_EXECUTIONS, "Tool executions by tool and result");
    describe_histogram!(
        TOOL_DURATION,
        Unit::Seconds,
        "Duration of one tool execution"
    );
    describe_counter!(DOOM_LOOPS, "Doom loops detected");
    describe_counter!(COMPACTIONS, "Compactions attempted, by trigger and outcome");
    describe_counter!(
        WEBHOOK_DELIVERIES,
        "Webhook delivery attempts, by outcome (delivered, retry, failed)"
    );
    describe_gauge!(WEBHOOKS_PENDING, "Webhook deliveries pending in the outbox");
    describe_gauge!(
        BREAKER_OPEN,
        "1 while the compaction circuit breaker is open"
    );
    describe_gauge!(
        BREAKER_FAILURES,
        "Consecutive failed compactions counted by the circuit breaker"
    );
}

/// One answered HTTP request.
pub fn http_request(method: &str, route: &str, status: u16, elapsed: Duration) {
    let labels = [
        ("method", method.to_owned()),
        ("route", route.to_owned()),
        ("status", status.to_string()),
    ];
    ::metrics::counter!(HTTP_REQUESTS, &labels).increment(1);
    ::metrics::histogram!(HTTP_DURATION, &labels).record(elapsed.as_secs_f64());
}

/// A run was created.
pub fn run_created() {
    ::metrics::counter!(RUNS_CREATED).increment(1);
}

/// A run's terminal event was written: it ended with `status`; a failed one is counted by its
/// `error_class` too.
pub fn run_finished(status: &'static str, error_class: Option<&'static str>) {
    match error_class {
        Some(class) => {
            ::metrics::counter!(RUNS_FINISHED, "status" => status, "error_class" => class)
                .increment(1);
        }
        None => ::metrics::counter!(RUNS_FINISHED, "status" => status).increment(1),
    }
}

/// A run ended with terminal `status` `elapsed` after its creation.
pub fn run_duration(status: &'static str, elapsed: Duration) {
    ::metrics::histogram!(RUN_DURATION, "status" => status).record(elapsed.as_secs_f64());
}

/// A run began (`+1`) or stopped (`-1`) waiting in `requires_action`.
pub fn runs_waiting(delta: f64) {
    ::metrics::gauge!(RUNS_WAITING).increment(delta);
}

/// A wait in `requires_action` ended with `outcome` (`answered`, `cancelled`, `expired`)
/// after `elapsed`; an expired one is counted in [`RUN_WAITS_EXPIRED`] too.
pub fn run_wait(outcome: &'static str, elapsed: Duration) {
    ::metrics::histogram!(RUN_WAIT, "outcome" => outcome).record(elapsed.as_secs_f64());
    if outcome == "expired" {
        ::metrics::counter!(RUN_WAITS_EXPIRED).increment(1);
    }
}

/// Reads the process's resident memory, open file descriptors, CPU time, threads, … into
/// the `process_*` metrics (the Prometheus client conventions), before a scrape renders them.
pub fn collect_process() {
    if let Some(collector) = PROCESS.get() {
        collector.collect();
    }
}

/// A run started (`+1`) or stopped (`-1`) executing in this process.
pub fn runs_active(delta: f64) {
    ::metrics::gauge!(RUNS_ACTIVE).increment(delta);
}

/// An event stream opened (`+1`) or closed (`-1`).
pub fn sse_watchers(delta: f64) {
    ::metrics::gauge!(SSE_WATCHERS).increment(delta);
}

/// One event-log batch of `events` committed in `elapsed`.
pub fn event_batch(events: usize, elapsed: Duration) {
    ::metrics::counter!(EVENTS_PERSISTED).increment(events as u64);
    #[expect(
        clippy::cast_precision_loss,
        reason = "a batch holds at most a few thousand"
    )]
    ::metrics::histogram!(EVENT_BATCH_SIZE).record(events as f64);
    ::metrics::histogram!(EVENT_COMMIT).record(elapsed.as_secs_f64());
}

/// A model call ended: `outcome` is `ok` or its error class; `elapsed` from request to end.
pub fn model_call(provider: &str, model: &str, outcome: &'static str, elapsed: Duration) {
    let (provider, model) = (provider.to_owned(), model.to_owned());
    ::metrics::counter!(MODEL_CALLS, "provider" => provider.clone(), "model" => model.clone(), "outcome" => outcome)
        .increment(1);
    ::metrics::histogram!(MODEL_DURATION, "provider" => provider, "model" => model)
        .record(elapsed.as_secs_f64());
}

/// A model call's first output arrived `elapsed` after its request.
pub fn time_to_first_token(provider: &str, model: &str, elapsed: Duration) {
    ::metrics::histogram!(MODEL_TTFT, "provider" => provider.to_owned(), "model" => model.to_owned())
        .record(elapsed.as_secs_f64());
}

/// Tokens of one model call, by kind (`input`, `output`, `cache_read`, `cache_write`).
pub fn tokens(provider: &str, model: &str, counts: [(&'static str, u64); 4]) {
    for (kind, count) in counts {
        if count > 0 {
            ::metrics::counter!(MODEL_TOKENS, "provider" => provider.to_owned(), "model" => model.to_owned(), "kind" => kind)
                .increment(count);
        }
    }
}

/// A model call is retried after failing with `error_class`.
pub fn model_retry(provider: &str, error_class: &'static str) {
    ::metrics::counter!(MODEL_RETRIES, "provider" => provider.to_owned(), "error_class" => error_class)
        .increment(1);
}

/// A tool execution ended with `success` or not, after `elapsed`.
pub fn tool_execution(tool: &str, success: bool, elapsed: Duration) {
    let result = if success { "success" } else { "failure" };
    ::metrics::counter!(TOOL_EXECUTIONS, "tool" => tool.to_owned(), "result" => result)
        .increment(1);
    ::metrics::histogram!(TOOL_DURATION, "tool" => tool.to_owned()).record(elapsed.as_secs_f64());
}

/// A doom loop was detected.
pub fn doom_loop() {
    ::metrics::counter!(DOOM_LOOPS).increment(1);
}

/// A compaction attempt by `trigger` ended: `compacted` or `failed`.
pub fn compaction(trigger: &'static str, compacted: bool) {
    let outcome = if compacted { "compacted" } else { "failed" };
    ::metrics::counter!(COMPACTIONS, "trigger" => trigger, "outcome" => outcome).increment(1);
}

/// The circuit breaker's state as the store has it now.
pub fn circuit_breaker(open: bool, consecutive_failures: u32) {
    ::metrics::gauge!(BREAKER_OPEN).set(if open { 1.0 } else { 0.0 });
    ::metrics::gauge!(BREAKER_FAILURES).set(f64::from(consecutive_failures));
}

/// A webhook delivery attempt ended with `outcome` (`delivered`, `retry`, `failed`).
pub fn webhook_attempt(outcome: &'static str) {
    ::metrics::counter!(WEBHOOK_DELIVERIES, "outcome" => outcome).increment(1);
}

/// `count` webhook delivery attempts were found cut short (`interrupted`: released at this
/// process's shutdown, or a claim of a process that died found expired).
pub fn webhook_attempts_interrupted(count: u64) {
    if count > 0 {
        ::metrics::counter!(WEBHOOK_DELIVERIES, "outcome" => "interrupted").increment(count);
    }
}

/// The webhook outbox holds `pending` deliveries not delivered or failed yet.
#[expect(
    clippy::cast_precision_loss,
    reason = "a gauge of a count far below 2^52"
)]
pub fn webhooks_pending(pending: u64) {
    ::metrics::gauge!(WEBHOOKS_PENDING).set(pending as f64);
}

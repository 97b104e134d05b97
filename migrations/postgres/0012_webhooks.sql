-- Issue 26 item 3: webhooks. A run's webhook (its URL) is stored in its `definition` JSON.
-- The outbox: one row per delivery a webhook is owed (a run's end, or its pause in
-- `requires_action`), written in the transaction of the event that causes it; the delivery
-- worker claims due rows (`locked_by`, `locked_until_ms`: a short claim that expires with a
-- dead process), posts them and records each attempt. Times are ms since the Unix epoch.
CREATE TABLE webhook_deliveries (
    id UUID PRIMARY KEY NOT NULL,
    run_id UUID NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    event_type TEXT NOT NULL,
    url TEXT NOT NULL,
    payload TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending',
    attempts BIGINT NOT NULL DEFAULT 0,
    created_ms BIGINT NOT NULL,
    next_attempt_ms BIGINT NOT NULL,
    locked_by TEXT,
    locked_until_ms BIGINT,
    last_status_code BIGINT,
    last_error TEXT,
    finished_ms BIGINT
);
CREATE INDEX webhook_deliveries_run ON webhook_deliveries (run_id);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_ms) WHERE status = 'pending';

-- Each attempt of a delivery, for `GET /runs/{run_id}/webhook-deliveries`.
CREATE TABLE webhook_attempts (
    delivery_id UUID NOT NULL REFERENCES webhook_deliveries (id) ON DELETE CASCADE,
    attempt BIGINT NOT NULL,
    started_ms BIGINT NOT NULL,
    duration_ms BIGINT NOT NULL,
    status_code BIGINT,
    error TEXT,
    outcome TEXT NOT NULL,
    PRIMARY KEY (delivery_id, attempt)
);

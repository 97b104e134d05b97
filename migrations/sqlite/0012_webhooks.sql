-- Issue 26 item 3: webhooks. A run's webhook (its URL) is stored in its `definition` JSON.
-- The outbox: one row per delivery a webhook is owed (a run's end, or its pause in
-- `requires_action`), written in the transaction of the event that causes it; the delivery
-- worker claims due rows (`locked_by`, `locked_until_ms`: a short claim that expires with a
-- dead process), posts them and records each attempt. Times are ms since the Unix epoch.
CREATE TABLE webhook_deliveries (
    id BLOB PRIMARY KEY NOT NULL,
    run_id BLOB NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    event_type TEXT NOT NULL,
    url TEXT NOT NULL,
    payload TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    created_ms INTEGER NOT NULL,
    next_attempt_ms INTEGER NOT NULL,
    locked_by TEXT,
    locked_until_ms INTEGER,
    last_status_code INTEGER,
    last_error TEXT,
    finished_ms INTEGER
);
CREATE INDEX webhook_deliveries_run ON webhook_deliveries (run_id);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_ms) WHERE status = 'pending';

-- Each attempt of a delivery, for `GET /runs/{run_id}/webhook-deliveries`.
CREATE TABLE webhook_attempts (
    delivery_id BLOB NOT NULL REFERENCES webhook_deliveries (id) ON DELETE CASCADE,
    attempt INTEGER NOT NULL,
    started_ms INTEGER NOT NULL,
    duration_ms INTEGER NOT NULL,
    status_code INTEGER,
    error TEXT,
    outcome TEXT NOT NULL,
    PRIMARY KEY (delivery_id, attempt)
);

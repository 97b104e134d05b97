-- Issue #9: snapshots, leases, cancel requests made while no process owns a run, retention.
-- A run is owned by one process through its lease (owner id, expiry in unix ms); another
-- process takes it over only once the lease has expired.
ALTER TABLE runs ADD COLUMN lease_owner TEXT;
ALTER TABLE runs ADD COLUMN lease_expires_ms INTEGER;
ALTER TABLE runs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0;
-- Set when retention removed the run's events (their reads answer 410).
ALTER TABLE runs ADD COLUMN events_removed_at TEXT;
CREATE INDEX runs_finished_by_time ON runs (updated_at)
    WHERE status IN ('completed', 'failed', 'cancelled') AND events_removed_at IS NULL;

-- One snapshot per run: its state at the last iteration boundary (written in the transaction of
-- that `model_started`), then its terminal status.
CREATE TABLE snapshots (
    run_id BLOB PRIMARY KEY NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    session_id BLOB NOT NULL,
    status TEXT NOT NULL,
    iteration INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    total_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL,
    usage_estimated INTEGER NOT NULL,
    tool_calls INTEGER NOT NULL,
    last_sequence INTEGER NOT NULL,
    created_at TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX snapshots_by_session ON snapshots (session_id, run_id);
CREATE INDEX snapshots_by_status ON snapshots (status, run_id);

-- Issue #9: snapshots, leases, cancel requests made while no process owns a run, retention.
-- A run is owned by one process through its lease (owner id, expiry in unix ms); another
-- process (a restarted one, or a replica) takes it over only once the lease has expired.
ALTER TABLE runs ADD COLUMN lease_owner TEXT;
ALTER TABLE runs ADD COLUMN lease_expires_ms BIGINT;
ALTER TABLE runs ADD COLUMN cancel_requested BOOLEAN NOT NULL DEFAULT FALSE;
-- Set when retention removed the run's events (their reads answer 410).
ALTER TABLE runs ADD COLUMN events_removed_at TIMESTAMPTZ;
CREATE INDEX runs_finished_by_time ON runs (updated_at)
    WHERE status IN ('completed', 'failed', 'cancelled') AND events_removed_at IS NULL;

-- One snapshot per run: its state at the last iteration boundary (written in the transaction of
-- that `model_started`), then its terminal status.
CREATE TABLE snapshots (
    run_id UUID PRIMARY KEY REFERENCES runs (id) ON DELETE CASCADE,
    session_id UUID NOT NULL,
    status TEXT NOT NULL,
    iteration BIGINT NOT NULL,
    input_tokens BIGINT NOT NULL,
    output_tokens BIGINT NOT NULL,
    total_tokens BIGINT NOT NULL,
    reasoning_tokens BIGINT NOT NULL,
    usage_estimated BOOLEAN NOT NULL,
    tool_calls BIGINT NOT NULL,
    last_sequence BIGINT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX snapshots_by_session ON snapshots (session_id, run_id);
CREATE INDEX snapshots_by_status ON snapshots (status, run_id);

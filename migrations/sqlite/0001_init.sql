-- Sessions, runs, messages and the event log. Ids are UUID v7 (BLOB), times RFC 3339 text,
-- JSON stored as text so it reads back byte for byte.
CREATE TABLE sessions (
    id BLOB PRIMARY KEY NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);

CREATE TABLE runs (
    id BLOB PRIMARY KEY NOT NULL,
    session_id BLOB NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    status TEXT NOT NULL,
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    tool_choice TEXT NOT NULL,
    metadata TEXT NOT NULL,
    iterations INTEGER NOT NULL,
    finish_reason TEXT,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    total_tokens INTEGER NOT NULL,
    error TEXT,
    tools TEXT,
    max_iterations INTEGER NOT NULL,
    client_request_id TEXT,
    request_hash TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE INDEX runs_by_session ON runs (session_id, id);
CREATE INDEX runs_by_status ON runs (status, id);
-- Idempotency: one run per client request id.
CREATE UNIQUE INDEX runs_by_client_request_id ON runs (client_request_id)
    WHERE client_request_id IS NOT NULL;
-- One active run per session: a second insert fails, whatever the timing.
CREATE UNIQUE INDEX runs_one_active_per_session ON runs (session_id)
    WHERE status NOT IN ('completed', 'failed', 'cancelled');

CREATE TABLE messages (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id BLOB NOT NULL UNIQUE,
    session_id BLOB NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    run_id BLOB NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    tool_calls TEXT NOT NULL,
    tool_call_id TEXT,
    tool_name TEXT,
    created_at TEXT NOT NULL
);
CREATE INDEX messages_by_session ON messages (session_id, seq);
CREATE INDEX messages_by_run ON messages (run_id, seq);

CREATE TABLE events (
    run_id BLOB NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    sequence INTEGER NOT NULL,
    event_type TEXT NOT NULL,
    data TEXT NOT NULL,
    terminal INTEGER NOT NULL,
    PRIMARY KEY (run_id, sequence)
) WITHOUT ROWID;

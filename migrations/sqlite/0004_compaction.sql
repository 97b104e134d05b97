-- Issue #10: compaction. The settings of /compaction and the circuit breaker (one row each,
-- shared by every process on the database), one row per compaction of a session's context
-- (every original message stays in `messages`), and each session's token calibration: the
-- input tokens the provider reported for its last model call and behest's own count of that
-- request.
CREATE TABLE compaction_settings (
    id INTEGER PRIMARY KEY NOT NULL CHECK (id = 1),
    auto INTEGER NOT NULL,
    prune INTEGER NOT NULL,
    buffer_tokens INTEGER NOT NULL,
    keep_tokens INTEGER NOT NULL,
    tail_turns INTEGER NOT NULL,
    model TEXT NOT NULL,
    provider TEXT NOT NULL,
    circuit_breaker_threshold INTEGER NOT NULL,
    updated_at TEXT NOT NULL
);

CREATE TABLE compaction_breaker (
    id INTEGER PRIMARY KEY NOT NULL CHECK (id = 1),
    consecutive_failures INTEGER NOT NULL,
    is_open INTEGER NOT NULL,
    opened_at TEXT,
    last_error TEXT
);
INSERT INTO compaction_breaker (id, consecutive_failures, is_open) VALUES (1, 0, 0);

CREATE TABLE compactions (
    id BLOB PRIMARY KEY NOT NULL,
    session_id BLOB NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    run_id BLOB REFERENCES runs (id) ON DELETE CASCADE,
    cause TEXT NOT NULL,
    through_message_id BLOB NOT NULL,
    -- `messages.seq` of `through_message_id`: orders a session's compactions and bounds the
    -- messages a run loads after the latest one.
    through_seq INTEGER NOT NULL,
    messages_summarised INTEGER NOT NULL,
    tokens_before INTEGER NOT NULL,
    tokens_after INTEGER NOT NULL,
    summary TEXT NOT NULL,
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    total_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL,
    usage_estimated INTEGER NOT NULL,
    created_at TEXT NOT NULL
);
CREATE INDEX compactions_by_session ON compactions (session_id, through_seq);

ALTER TABLE sessions ADD COLUMN context_reported_tokens INTEGER;
ALTER TABLE sessions ADD COLUMN context_counted_tokens INTEGER;

-- A run's context after a compaction: the session's system messages and its latest user input
-- are found without reading the whole history.
CREATE INDEX messages_system_by_session ON messages (session_id, seq) WHERE role = 'system';
CREATE INDEX messages_user_by_session ON messages (session_id, seq) WHERE role = 'user';

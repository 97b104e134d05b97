-- Issue #10: compaction. The settings of /compaction and the circuit breaker (one row each,
-- shared by every process on the database), one row per compaction of a session's context
-- (every original message stays in `messages`), and each session's token calibration: the
-- input tokens the provider reported for its last model call and behest's own count of that
-- request.
CREATE TABLE compaction_settings (
    id SMALLINT PRIMARY KEY CHECK (id = 1),
    auto BOOLEAN NOT NULL,
    prune BOOLEAN NOT NULL,
    buffer_tokens BIGINT NOT NULL,
    keep_tokens BIGINT NOT NULL,
    tail_turns BIGINT NOT NULL,
    model TEXT NOT NULL,
    provider TEXT NOT NULL,
    circuit_breaker_threshold BIGINT NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL
);

CREATE TABLE compaction_breaker (
    id SMALLINT PRIMARY KEY CHECK (id = 1),
    consecutive_failures BIGINT NOT NULL,
    is_open BOOLEAN NOT NULL,
    opened_at TIMESTAMPTZ,
    last_error TEXT
);
INSERT INTO compaction_breaker (id, consecutive_failures, is_open) VALUES (1, 0, FALSE);

CREATE TABLE compactions (
    id UUID PRIMARY KEY,
    session_id UUID NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    run_id UUID REFERENCES runs (id) ON DELETE CASCADE,
    cause TEXT NOT NULL,
    through_message_id UUID NOT NULL,
    -- `messages.seq` of `through_message_id`: orders a session's compactions and bounds the
    -- messages a run loads after the latest one.
    through_seq BIGINT NOT NULL,
    messages_summarised BIGINT NOT NULL,
    tokens_before BIGINT NOT NULL,
    tokens_after BIGINT NOT NULL,
    summary TEXT NOT NULL,
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    input_tokens BIGINT NOT NULL,
    output_tokens BIGINT NOT NULL,
    total_tokens BIGINT NOT NULL,
    reasoning_tokens BIGINT NOT NULL,
    usage_estimated BOOLEAN NOT NULL,
    created_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX compactions_by_session ON compactions (session_id, through_seq);

ALTER TABLE sessions ADD COLUMN context_reported_tokens BIGINT;
ALTER TABLE sessions ADD COLUMN context_counted_tokens BIGINT;

-- A run's context after a compaction: the session's system messages and its latest user input
-- are found without reading the whole history.
CREATE INDEX messages_system_by_session ON messages (session_id, seq) WHERE role = 'system';
CREATE INDEX messages_user_by_session ON messages (session_id, seq) WHERE role = 'user';

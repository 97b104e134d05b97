-- Issue #11: agents. A run's agent preset and definition (instructions, model parameters,
-- provider options, approvals, limits: JSON), what it waits for while `requires_action`, the
-- answers (tool outputs, approvals) posted for it until the run commits them, a message's
-- status (`incomplete` for the text of a call its run ended in), and sessions' title,
-- metadata and run defaults.
ALTER TABLE runs ADD COLUMN agent TEXT;
ALTER TABLE runs ADD COLUMN definition TEXT NOT NULL DEFAULT '{}';
ALTER TABLE runs ADD COLUMN required_action TEXT;
ALTER TABLE messages ADD COLUMN status TEXT NOT NULL DEFAULT 'completed';
ALTER TABLE sessions ADD COLUMN title TEXT;
ALTER TABLE sessions ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}';
ALTER TABLE sessions ADD COLUMN defaults TEXT NOT NULL DEFAULT '{}';

-- One answer per pending call of a turn (the assistant message that made the calls: a model may
-- use a call id again in a later turn): a second one is refused by the primary key.
CREATE TABLE action_answers (
    run_id BLOB NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    message_id BLOB NOT NULL,
    call_id TEXT NOT NULL,
    answer TEXT NOT NULL,
    created_at TEXT NOT NULL,
    PRIMARY KEY (run_id, message_id, call_id)
) WITHOUT ROWID;

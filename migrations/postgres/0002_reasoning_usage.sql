-- Issue #8: reasoning blocks stored with assistant messages (JSON array of
-- {text, signature?, redacted_data?}), reasoning tokens and the "estimated" mark of run totals.
ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT '[]';
ALTER TABLE runs ADD COLUMN reasoning_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN usage_estimated BOOLEAN NOT NULL DEFAULT FALSE;

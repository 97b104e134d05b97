-- Issue #8: reasoning blocks stored with assistant messages (JSON array of
-- {text, signature?, redacted_data?}), reasoning tokens and the "estimated" mark of run totals.
ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT '[]';
ALTER TABLE runs ADD COLUMN reasoning_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN usage_estimated INTEGER NOT NULL DEFAULT 0;

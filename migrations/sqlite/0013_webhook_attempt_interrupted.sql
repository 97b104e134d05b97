-- A delivery attempt is written when its delivery is claimed, as `interrupted` (no duration
-- yet), and its end replaces it: an attempt whose process died in the middle stays listed.
-- `duration_ms` may be NULL; SQLite cannot drop a NOT NULL constraint: the table is rebuilt.
CREATE TABLE webhook_attempts_new (
    delivery_id BLOB NOT NULL REFERENCES webhook_deliveries (id) ON DELETE CASCADE,
    attempt INTEGER NOT NULL,
    started_ms INTEGER NOT NULL,
    duration_ms INTEGER,
    status_code INTEGER,
    error TEXT,
    outcome TEXT NOT NULL,
    PRIMARY KEY (delivery_id, attempt)
);
INSERT INTO webhook_attempts_new
SELECT delivery_id, attempt, started_ms, duration_ms, status_code, error, outcome
FROM webhook_attempts;
DROP TABLE webhook_attempts;
ALTER TABLE webhook_attempts_new RENAME TO webhook_attempts;

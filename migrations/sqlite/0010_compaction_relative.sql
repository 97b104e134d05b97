-- Issue 24, item 6: `buffer_tokens` and `keep_tokens` may be unset (NULL): relative to each
-- model's window (see `CompactionConfig::buffer_for` / `keep_for`). A stored value equal to the
-- old absolute default (20000, 8000) was stored by a PATCH of another field, not chosen: it
-- becomes unset. SQLite cannot drop a NOT NULL constraint: the table is rebuilt.
CREATE TABLE compaction_settings_new (
    id INTEGER PRIMARY KEY NOT NULL CHECK (id = 1),
    auto INTEGER NOT NULL,
    prune INTEGER NOT NULL,
    buffer_tokens INTEGER,
    keep_tokens INTEGER,
    tail_turns INTEGER NOT NULL,
    model TEXT NOT NULL,
    provider TEXT NOT NULL,
    circuit_breaker_threshold INTEGER NOT NULL,
    updated_at TEXT NOT NULL
);
INSERT INTO compaction_settings_new
SELECT id, auto, prune,
       CASE WHEN buffer_tokens = 20000 THEN NULL ELSE buffer_tokens END,
       CASE WHEN keep_tokens = 8000 THEN NULL ELSE keep_tokens END,
       tail_turns, model, provider, circuit_breaker_threshold, updated_at
FROM compaction_settings;
DROP TABLE compaction_settings;
ALTER TABLE compaction_settings_new RENAME TO compaction_settings;

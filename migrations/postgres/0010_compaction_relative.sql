-- Issue 24, item 6: `buffer_tokens` and `keep_tokens` may be unset (NULL): relative to each
-- model's window (see `CompactionConfig::buffer_for` / `keep_for`). A stored value equal to the
-- old absolute default (20000, 8000) was stored by a PATCH of another field, not chosen: it
-- becomes unset.
ALTER TABLE compaction_settings ALTER COLUMN buffer_tokens DROP NOT NULL;
ALTER TABLE compaction_settings ALTER COLUMN keep_tokens DROP NOT NULL;
UPDATE compaction_settings SET buffer_tokens = NULL WHERE buffer_tokens = 20000;
UPDATE compaction_settings SET keep_tokens = NULL WHERE keep_tokens = 8000;

-- A run taken over from a process that died without releasing it (a crash, kill -9) counts its
-- takeovers; a message the run commits (its next boundary) sets the count back to 0. A run
-- taken over more than `max_takeovers` times without a new boundary is failed (error class
-- `crash_loop`) instead of resumed again.
ALTER TABLE runs ADD COLUMN takeovers BIGINT NOT NULL DEFAULT 0;

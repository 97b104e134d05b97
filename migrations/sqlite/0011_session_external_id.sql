-- Issue 25, item 3: a session may carry the id a web client chose for its conversation (a
-- `useChat` chat id, an AG-UI threadId), unique among sessions; NULL for sessions without one.
ALTER TABLE sessions ADD COLUMN external_id TEXT;
CREATE UNIQUE INDEX sessions_external_id ON sessions (external_id);

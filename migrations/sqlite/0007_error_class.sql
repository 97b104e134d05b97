-- Issue #22: a failed run's `error_class` on its record and its snapshot, written in the
-- transaction of its `run_failed` event. Runs that failed before keep theirs from that event
-- (kind 15) while their log is kept: a compact row's body is its fields after `"error":`, a
-- verbatim row's the whole JSON.
ALTER TABLE runs ADD COLUMN error_class TEXT;
ALTER TABLE snapshots ADD COLUMN error_class TEXT;

UPDATE runs SET error_class = (
    SELECT json_extract(
        CASE WHEN e.emitted_at IS NULL THEN e.body ELSE '{"error":' || e.body || '}' END,
        '$.error_class')
    FROM events e
    WHERE e.run_id = runs.id AND e.kind = 15 AND json_valid(
        CASE WHEN e.emitted_at IS NULL THEN e.body ELSE '{"error":' || e.body || '}' END)
)
WHERE status = 'failed';

UPDATE snapshots SET error_class = (SELECT r.error_class FROM runs r WHERE r.id = snapshots.run_id)
WHERE status = 'failed';

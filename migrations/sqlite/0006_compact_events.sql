-- Issue 14: each event's payload is stored once and its envelope as compact values, from which
-- the JSON sent live is derived again byte for byte (src/events/stored.rs): `kind` codes the
-- `type`; `emitted_at` is the timestamp in ns since the Unix epoch; `span_id` and `trace_id`
-- are bytes (`trace_id` NULL: the run id's hex); `body` holds the payload fields after the
-- kind's first field name. A row whose JSON the compact values would not give back exactly
-- stays verbatim: `emitted_at` NULL and `body` the whole JSON. `terminal` follows from `kind`.
CREATE TABLE events_compact (
    run_id BLOB NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    sequence INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    emitted_at INTEGER,
    span_id BLOB,
    trace_id BLOB,
    body TEXT NOT NULL,
    PRIMARY KEY (run_id, sequence)
) WITHOUT ROWID;

INSERT INTO events_compact (run_id, sequence, kind, emitted_at, span_id, trace_id, body)
WITH kinds (code, tag, first_field) AS (VALUES
    (1, 'run_started', 'session_id'),
    (2, 'context_built', 'message_count'),
    (3, 'model_started', 'provider'),
    (4, 'text_delta', 'delta'),
    (5, 'tool_call_started', 'call_id'),
    (6, 'tool_call_delta', 'call_id'),
    (7, 'tool_call_completed', 'call'),
    (8, 'tool_execution_started', 'call_id'),
    (9, 'tool_execution_finished', 'call_id'),
    (10, 'assistant_message_committed', 'message_id'),
    (11, 'tool_message_committed', 'message_id'),
    (12, 'usage_recorded', 'usage'),
    (13, 'cache_metrics', 'cache_creation_input_tokens'),
    (14, 'run_completed', 'finish_reason'),
    (15, 'run_failed', 'error'),
    (16, 'run_cancelled', ''),
    (17, 'doom_loop_detected', 'description'),
    (18, 'compaction_circuit_opened', 'consecutive_failures'),
    (19, 'reasoning_delta', 'delta'),
    (20, 'model_retrying', 'attempt'),
    (21, 'run_resumed', 'iteration'),
    (22, 'tool_calls_required', 'message_id'),
    (23, 'context_compacted', 'compaction_id')
),
-- The envelope's strings, cut at the separators the serializer writes.
s1 AS (
    SELECT e.run_id, e.sequence, e.data, k.code, k.tag, k.first_field,
           lower(hex(e.run_id)) AS simple,
           substr(e.data, instr(e.data, ',"timestamp":"') + 14) AS r1
    FROM events e LEFT JOIN kinds k ON k.tag = e.event_type
),
s2 AS (
    SELECT *, substr(r1, 1, instr(r1, '","trace_id":"') - 1) AS ts,
           substr(r1, instr(r1, '","trace_id":"') + 14) AS r2
    FROM s1
),
s3 AS (
    SELECT *, substr(r2, 1, instr(r2, '","span_id":"') - 1) AS trace,
           substr(r2, instr(r2, '","span_id":"') + 13) AS r3
    FROM s2
),
s4 AS (
    SELECT *, substr(r3, 1, instr(r3, '","type":"') - 1) AS span,
           substr(r3, instr(r3, '","type":"') + 10 + length(tag) + 1) AS tail
    FROM s3
),
s5 AS (
    SELECT *, CASE WHEN tail = '}' THEN '' ELSE substr(tail, 2, length(tail) - 2) END AS fields
    FROM s4
),
-- The compact values.
compact AS (
    SELECT run_id, sequence, data, code, tag, first_field, simple,
           CASE WHEN first_field = '' THEN fields
                ELSE substr(fields, length(first_field) + 4) END AS body,
           unixepoch(substr(ts, 1, 19)) * 1000000000
               + CAST(substr(CASE WHEN length(ts) > 20 THEN substr(ts, 21, length(ts) - 21)
                                  ELSE '' END || '000000000', 1, 9) AS INTEGER) AS emitted_at,
           unhex(span) AS span_id,
           CASE WHEN trace = simple THEN NULL ELSE unhex(trace) END AS trace_id,
           trace = simple OR length(unhex(trace)) = 16 AS trace_ok
    FROM s5
),
-- What the server renders from them (StoredEvent::render).
rendered AS (
    SELECT *,
        '{"sequence":' || sequence
        || ',"run_id":"' || substr(simple, 1, 8) || '-' || substr(simple, 9, 4) || '-'
            || substr(simple, 13, 4) || '-' || substr(simple, 17, 4) || '-' || substr(simple, 21)
        || '","timestamp":"'
            || strftime('%Y-%m-%dT%H:%M:%S', emitted_at / 1000000000, 'unixepoch')
            || CASE WHEN emitted_at % 1000000000 = 0 THEN ''
                    WHEN emitted_at % 1000000 = 0
                        THEN printf('.%03d', emitted_at % 1000000000 / 1000000)
                    WHEN emitted_at % 1000 = 0
                        THEN printf('.%06d', emitted_at % 1000000000 / 1000)
                    ELSE printf('.%09d', emitted_at % 1000000000) END
            || 'Z'
        || '","trace_id":"' || CASE WHEN trace_id IS NULL THEN simple ELSE lower(hex(trace_id)) END
        || '","span_id":"' || lower(hex(span_id))
        || '","type":"' || tag || '"'
        || CASE WHEN first_field = '' AND body = '' THEN '}'
                ELSE ',' || CASE WHEN first_field = '' THEN '' ELSE '"' || first_field || '":' END
                     || body || '}' END AS render
    FROM compact
),
checked AS (
    SELECT *, COALESCE(code IS NOT NULL AND emitted_at > 0 AND length(span_id) = 8
                       AND trace_ok AND render = data, 0) AS ok
    FROM rendered
)
SELECT run_id, sequence, COALESCE(code, 0),
       CASE WHEN ok THEN emitted_at END,
       CASE WHEN ok THEN span_id END,
       CASE WHEN ok THEN trace_id END,
       CASE WHEN ok THEN body ELSE data END
FROM checked;

DROP TABLE events;
ALTER TABLE events_compact RENAME TO events;

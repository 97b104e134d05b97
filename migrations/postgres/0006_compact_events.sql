-- Issue 14: each event's payload is stored once and its envelope as compact values, from which
-- the JSON sent live is derived again byte for byte (src/events/stored.rs): `kind` codes the
-- `type`; `emitted_at` is the timestamp in ns since the Unix epoch; `span_id` and `trace_id`
-- are bytes (`trace_id` NULL: the run id's hex); `body` holds the payload fields after the
-- kind's first field name. A row whose JSON the compact values would not give back exactly
-- stays verbatim: `emitted_at` NULL and `body` the whole JSON. `terminal` follows from `kind`.
CREATE TABLE events_compact (
    run_id UUID NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    sequence BIGINT NOT NULL,
    emitted_at BIGINT,
    kind SMALLINT NOT NULL,
    span_id BYTEA,
    trace_id BYTEA,
    body TEXT NOT NULL,
    PRIMARY KEY (run_id, sequence)
);

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
-- The envelope's strings, cut at the separators the serializer writes (never an error: a row
-- without them just does not render back, below).
s1 AS (
    SELECT e.run_id, e.sequence, e.data, k.code, k.tag, k.first_field,
           replace(e.run_id::text, '-', '') AS simple,
           substr(e.data, strpos(e.data, ',"timestamp":"') + 14) AS r1
    FROM events e LEFT JOIN kinds k ON k.tag = e.event_type
),
s2 AS (
    SELECT *, split_part(r1, '","trace_id":"', 1) AS ts,
           substr(r1, strpos(r1, '","trace_id":"') + 14) AS r2
    FROM s1
),
s3 AS (
    SELECT *, split_part(r2, '","span_id":"', 1) AS trace,
           substr(r2, strpos(r2, '","span_id":"') + 13) AS r3
    FROM s2
),
s4 AS (
    SELECT *, split_part(r3, '","type":"', 1) AS span,
           substr(r3, strpos(r3, '","type":"') + 10 + length(tag) + 1) AS tail
    FROM s3
),
s5 AS (
    SELECT *, CASE WHEN tail = '}' THEN '' ELSE substr(tail, 2, greatest(length(tail) - 2, 0)) END
               AS fields
    FROM s4
),
-- The compact values; strings that do not have the shapes the server writes give NULLs.
compact AS (
    SELECT run_id, sequence, data, code, tag, first_field, simple,
           CASE WHEN first_field = '' THEN fields
                ELSE substr(fields, length(first_field) + 4) END AS body,
           CASE WHEN ts ~ '^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{3}|\.\d{6}|\.\d{9})?Z$'
                THEN extract(epoch FROM (substr(ts, 1, 19) || 'Z')::timestamptz)::bigint * 1000000000
                     + rpad(CASE WHEN length(ts) > 20 THEN substr(ts, 21, length(ts) - 21)
                                 ELSE '' END, 9, '0')::bigint END AS emitted_at,
           CASE WHEN span ~ '^[0-9a-f]{16}$' THEN decode(span, 'hex') END AS span_id,
           CASE WHEN trace = simple THEN NULL
                WHEN trace ~ '^[0-9a-f]{32}$' THEN decode(trace, 'hex') END AS trace_id,
           trace = simple OR trace ~ '^[0-9a-f]{32}$' AS trace_ok
    FROM s5
),
-- What the server renders from them (StoredEvent::render).
rendered AS (
    SELECT *,
        '{"sequence":' || sequence
        || ',"run_id":"' || run_id::text
        || '","timestamp":"'
            || to_char(to_timestamp(emitted_at / 1000000000) AT TIME ZONE 'UTC',
                       'YYYY-MM-DD"T"HH24:MI:SS')
            || CASE WHEN emitted_at % 1000000000 = 0 THEN ''
                    WHEN emitted_at % 1000000 = 0
                        THEN '.' || lpad((emitted_at % 1000000000 / 1000000)::text, 3, '0')
                    WHEN emitted_at % 1000 = 0
                        THEN '.' || lpad((emitted_at % 1000000000 / 1000)::text, 6, '0')
                    ELSE '.' || lpad((emitted_at % 1000000000)::text, 9, '0') END
            || 'Z'
        || '","trace_id":"' || CASE WHEN trace_id IS NULL THEN simple ELSE encode(trace_id, 'hex') END
        || '","span_id":"' || encode(span_id, 'hex')
        || '","type":"' || tag || '"'
        || CASE WHEN first_field = '' AND body = '' THEN '}'
                ELSE ',' || CASE WHEN first_field = '' THEN '' ELSE '"' || first_field || '":' END
                     || body || '}' END AS render
    FROM compact
),
checked AS (
    SELECT *, COALESCE(code IS NOT NULL AND emitted_at > 0 AND span_id IS NOT NULL
                       AND trace_ok AND render = data, FALSE) AS ok
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
ALTER INDEX events_compact_pkey RENAME TO events_pkey;
ALTER TABLE events RENAME CONSTRAINT events_compact_run_id_fkey TO events_run_id_fkey;

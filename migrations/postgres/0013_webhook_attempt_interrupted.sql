-- A delivery attempt is written when its delivery is claimed, as `interrupted` (no duration
-- yet), and its end replaces it: an attempt whose process died in the middle stays listed.
ALTER TABLE webhook_attempts ALTER COLUMN duration_ms DROP NOT NULL;

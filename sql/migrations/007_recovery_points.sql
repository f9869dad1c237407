-- 007: recovery points of work in steps (docs/sql-api.md, "Work in steps").
--
-- A lease claim in progress can record named steps (idem_step): each step's writes and its
-- recovery point commit in the caller's transaction, fenced by the claim's token. The recovery
-- point lives on the key's own row, in two nullable columns:
--
--   - recovery_point: the name of the last step recorded in the key's current generation;
--   - recovery_saved: a JSON object, each recorded step's name to the small JSON value it
--     saved (at most 8192 bytes as text in all).
--
-- A takeover of the same generation (a lease that ran out or was given up, idem_yield) keeps
-- them and idem_begin hands them to the new holder; a new generation (a claim of an expired or
-- released key) starts without; an answer (idem_complete) clears them. On the row and not in
-- a side table: the row lock that fences the answer fences the steps too (a takeover's FOR
-- UPDATE waits for a step's transaction, and then reads its recovery point), and idem_cleanup
-- deletes them with the key.
--
-- Expand only: two nullable columns without a default are a change of the catalog, no rewrite
-- and no scan, whatever the table's size; the previous release (0.2.0) names the columns it
-- reads and writes, so it serves beside them. ADD COLUMN takes the key table's ACCESS
-- EXCLUSIVE lock: idemsql.Migrate and sql/idem.sql add the columns before their transaction
-- (online/007_columns.sql, a statement that commits at once), so the lock lasts a catalog
-- change, and this migration then finds them and takes no lock on the key table at all. A
-- migrate that had no such step (tern alone) adds them here, with the same short lock timeout
-- asked again until it is had; the lock then lasts until the migrate commits.
{{ template "online/007_columns.sql" . }}
---- create above / drop below ----

ALTER TABLE idem.idempotency_keys DROP COLUMN IF EXISTS recovery_point, DROP COLUMN IF EXISTS recovery_saved;

-- The pg_cron recipe of docs/sql-api.md, run by tests/pgcron_test.go with psql as the roles it
-- names, on a cluster with pg_cron; idem_owner is the role that installed schema idem.
-- As a superuser, once, in the database of schema idem (cron.database_name): the extension,
-- and the owner of schema idem may schedule jobs.
CREATE EXTENSION IF NOT EXISTS pg_cron;
GRANT USAGE ON SCHEMA cron TO idem_owner;
-- As idem_owner: every minute, every expired key, 5,000 per transaction; and a vacuum of the
-- key table, which only its owner may run, so that the space of the deleted rows is reused.
\c - idem_owner
SELECT cron.schedule('idem-cleanup', '* * * * *', $$CALL idem.idem_cleanup_all(5000)$$);
SELECT cron.schedule('idem-vacuum', '* * * * *', $$VACUUM (SKIP_LOCKED) idem.idempotency_keys$$);

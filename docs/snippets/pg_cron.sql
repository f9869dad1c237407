-- Every minute, every expired key, 5,000 per transaction; and a vacuum of the key table, so
-- that the space of the deleted rows is reused (docs/sql-api.md; run by the pg_cron test).
SELECT cron.schedule('idem-cleanup', '* * * * *', $$CALL idem.idem_cleanup_all(5000)$$);
SELECT cron.schedule('idem-vacuum', '* * * * *', $$VACUUM (SKIP_LOCKED) idem.idempotency_keys$$);

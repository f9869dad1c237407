-- Every minute, every expired key, 5,000 per transaction (docs/sql-api.md; run by the pg_cron test).
SELECT cron.schedule('idem-cleanup', '* * * * *', $$CALL idem.idem_cleanup_all(5000)$$);

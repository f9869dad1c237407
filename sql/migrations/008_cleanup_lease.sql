-- 008: the cleanup lease: one cleanup pass at a time across every process on the database
-- (docs/operations.md, "Cleanup"; D282).
--
-- A pass is batches with pauses between them. The cleanup lock (an advisory lock, taken by each
-- batch for its transaction) keeps two batches from running at once, but it is free during a
-- pause, so two replicas' passes could take turns batch by batch. The lease is one row: the pass
-- that holds it, and until when. idem_cleanup_leased takes or renews it in each batch's
-- transaction, for the pause after the batch and a margin, and frees it when its batch comes
-- back short (the pass's end); a pass that finds another's lease running is skipped or stops.
-- A process that dies mid-pass leaves the lease to run out.
--
-- Expand only: a new table of one row; it touches nothing the previous release reads or locks.
CREATE TABLE idem.cleanup_lease (
    id    boolean PRIMARY KEY DEFAULT true CHECK (id),
    pass  uuid,
    until timestamptz NOT NULL DEFAULT '-infinity'
);
REVOKE ALL ON idem.cleanup_lease FROM PUBLIC;
COMMENT ON TABLE idem.cleanup_lease IS
    'The cleanup pass that holds the lease, and until when (one row); private to the schema''s owner, written by idem_cleanup_leased.';
INSERT INTO idem.cleanup_lease DEFAULT VALUES;
---- create above / drop below ----

DROP TABLE IF EXISTS idem.cleanup_lease;

-- An account's revision: the count of its changes, which its ETag and "version" show. The
-- integer column version ran out after 2^31 - 1 changes (every later deposit or transfer of
-- the account failed with 22003, and a deposit was answered balance_limit). revision is a
-- bigint beside it, added without a rewrite or a scan (a nullable column without a default:
-- a change of the catalog, under a lock held for an instant), and NULL until the account's
-- next change. Each change of the next release sets revision, and version to the revision
-- wrapped into 1 to 2^30, so the previous release's "version + 1" has room for 2^30 more
-- changes and never overflows while it serves. The server reads the revision plus what version
-- has gained over its wrapped value (the previous release's changes, during the upgrade), or
-- version while revision is NULL (D162).
ALTER TABLE ledger.accounts ADD COLUMN revision bigint;

COMMENT ON COLUMN ledger.accounts.revision IS
    'The count of the account''s changes (its ETag), NULL until its first change after ledger migration 007. The version is coalesce(revision + version - ((revision - 1) % 1073741824 + 1), version).';

---- create above / drop below ----

ALTER TABLE ledger.accounts DROP COLUMN IF EXISTS revision;

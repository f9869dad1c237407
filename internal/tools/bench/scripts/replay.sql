\set r random(1, 100000)
BEGIN;
SELECT * FROM idem.idem_begin(p_principal => 'bench', p_key => 'r' || :r, p_action => 'POST /v1/transfers', p_request_sha256 => sha256(('r' || :r)::bytea));
COMMIT;

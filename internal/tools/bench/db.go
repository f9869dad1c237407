package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/hex"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
	idemsql "github.com/pgidem/pgidem/sql"
)

// The benchmark's fixed request: who, what, and the response that is stored.
const (
	principal = "bench"
	action    = "POST /v1/transfers"
	path      = "/v1/transfers"
	// replayKeys completed keys are stored in the bench databases for the replay variant.
	replayKeys = 100_000
	accounts   = 100_000
)

var (
	responseBody   = []byte(`{"id":1,"from":1,"to":2,"amount":1}`)
	responseHeader = map[string][]string{"Content-Type": {"application/json"}}
	// responseHeaderJSON is responseHeader as the functions store it (dbidem encodes one
	// string per header name).
	responseHeaderJSON = `{"Content-Type":"application/json"}`
)

// The effect: the same money transfer in every variant, two statements, each its own round
// trip.
const (
	effectInsert = `INSERT INTO bench_transfers (from_id, to_id, amount) VALUES ($1, $2, 1)`
	effectUpdate = `UPDATE bench_accounts SET balance = balance + 1 WHERE id = $1`
)

// databases that the parts use, with what each needs.
type dbSpec struct {
	// bank: bench_accounts (100,000) and bench_transfers, the effect's tables.
	bank bool
	// replays: replayKeys completed keys, and the seed tutorial's table.
	replays bool
	// noguard: the commit guard's foreign key dropped.
	noguard bool
	// noset: idem_begin and idem_complete without their SET clauses (search_path and
	// lock_timeout), to measure what the clauses' save and restore costs per call.
	noset bool
}

var databases = map[string]dbSpec{
	"bench":         {bank: true, replays: true},
	"bench_noguard": {bank: true, replays: true, noguard: true},
	"bench_noset":   {bank: true, replays: true, noset: true},
	"bench_cleanup": {bank: true},
	"bench_rows":    {},
}

// database sets up db (once per run) and returns its name.
func (b *bench) database(ctx context.Context, db string) error {
	if b.ready[db] {
		return nil
	}
	spec, ok := databases[db]
	if !ok {
		return fmt.Errorf("no database %s", db)
	}
	what := "the idem schema"
	if spec.bank {
		what += fmt.Sprintf(", %d accounts", accounts)
	}
	if spec.replays {
		what += fmt.Sprintf(", %d completed keys, the seed tutorial's table", replayKeys)
	}
	if spec.noguard {
		what += ", no commit guard"
	}
	if spec.noset {
		what += ", idem_begin and idem_complete without SET clauses"
	}
	fmt.Printf("setting up database %s: %s\n", db, what)
	if err := recreate(ctx, b.url, db); err != nil {
		return err
	}
	conn, err := connect(ctx, b.url, db)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if err := idemsql.Migrate(ctx, conn, idemsql.Options{}); err != nil {
		return fmt.Errorf("migrate %s: %w", db, err)
	}
	var stmts []string
	if spec.bank {
		stmts = append(stmts,
			`CREATE TABLE bench_accounts (id integer PRIMARY KEY, balance bigint NOT NULL)`,
			fmt.Sprintf(`INSERT INTO bench_accounts SELECT i, 0 FROM generate_series(1, %d) i`, accounts),
			`CREATE TABLE bench_transfers (id bigserial PRIMARY KEY, from_id integer NOT NULL, to_id integer NOT NULL,
			   amount bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`)
	}
	if spec.replays {
		stmts = append(stmts,
			`CREATE TABLE seed_keys (user_id bigint, key text, fingerprint bytea, response_status int,
			   response_body bytea, created_at timestamptz, PRIMARY KEY (user_id, key))`,
			`CREATE INDEX ON seed_keys (created_at)`)
	}
	if spec.noguard {
		stmts = append(stmts, `ALTER TABLE idem.idempotency_keys DROP CONSTRAINT `+dbidem.GuardConstraint)
	}
	if spec.noset {
		stmts = append(stmts, `DO $$
			DECLARE f regprocedure;
			BEGIN
				FOR f IN SELECT p.oid FROM pg_proc AS p WHERE p.pronamespace = 'idem'::regnamespace
				            AND p.proname IN ('idem_begin', 'idem_complete') LOOP
					EXECUTE format('ALTER FUNCTION %s RESET ALL', f);
				END LOOP;
			END $$`)
	}
	for _, s := range stmts {
		if _, err := conn.Exec(ctx, s); err != nil {
			return fmt.Errorf("%s: %s: %w", db, firstLine(s), err)
		}
	}
	if err := checkFieldsBlob(ctx, conn); err != nil {
		return err
	}
	if spec.replays {
		// Loaded packed, then set back to the table's fillfactor: a bulk load at 95 leaves
		// room for one more row in every page, and the runs' claims would each go into a
		// random old page that the free space map offers, reading it and writing its
		// full-page image after the run's checkpoint (7.7 KB of WAL per claim, measured with
		// the cpu part), where a production table's claims go to the pages cleanup emptied
		// (as in the scale part).
		var ff string
		if err := conn.QueryRow(ctx, `SELECT coalesce((SELECT o FROM pg_class, unnest(reloptions) AS o
			 WHERE oid = 'idem.idempotency_keys'::regclass AND o LIKE 'fillfactor=%'), 'fillfactor=100')`).Scan(&ff); err != nil {
			return err
		}
		if _, err := conn.Exec(ctx, `ALTER TABLE idem.idempotency_keys SET (fillfactor = 100)`); err != nil {
			return err
		}
		if err := insertReplayKeys(ctx, conn); err != nil {
			return fmt.Errorf("%s: replay keys: %w", db, err)
		}
		if _, err := conn.Exec(ctx, `ALTER TABLE idem.idempotency_keys SET (`+ff+`)`); err != nil {
			return err
		}
		// The seed tutorial's table holds as many keys as ours, loaded the same way: its
		// statements then find an index and a heap of the same size.
		if _, err := conn.Exec(ctx, `INSERT INTO seed_keys (user_id, key, fingerprint, response_status, response_body, created_at)
			SELECT 2, k.key, k.request_sha256, k.response_status, k.response_body, now() - interval '1 hour'
			  FROM idem.idempotency_keys AS k`); err != nil {
			return fmt.Errorf("%s: seed keys: %w", db, err)
		}
	}
	if _, err := conn.Exec(ctx, `VACUUM ANALYZE`); err != nil {
		return err
	}
	b.ready[db] = true
	return nil
}

// recreate drops db (if it exists) and creates it empty.
func recreate(ctx context.Context, url, db string) error {
	if err := sqlExec(ctx, url, "", "DROP DATABASE IF EXISTS "+db+" WITH (FORCE)"); err != nil {
		return err
	}
	return sqlExec(ctx, url, "", "CREATE DATABASE "+db)
}

func connConfig(url, db string) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	if db != "" {
		cfg.Database = db
	}
	return cfg, nil
}

func connect(ctx context.Context, url, db string) (*pgx.Conn, error) {
	cfg, err := connConfig(url, db)
	if err != nil {
		return nil, err
	}
	return pgx.ConnectConfig(ctx, cfg)
}

func sqlExec(ctx context.Context, url, db, sql string) error {
	conn, err := connect(ctx, url, db)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

// openPool opens a pool of conns connections to db with pgx's defaults (statement cache
// mode), after tune, and opens every connection.
func openPool(ctx context.Context, url, db string, conns int, tune func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	cc, err := connConfig(url, db)
	if err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig("")
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig = cc
	cfg.MaxConns = int32(conns)
	if tune != nil {
		tune(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	held := make([]*pgxpool.Conn, 0, conns)
	defer func() {
		for _, c := range held {
			c.Release()
		}
	}()
	for range conns {
		c, err := pool.Acquire(ctx)
		if err != nil {
			pool.Close()
			return nil, err
		}
		held = append(held, c)
	}
	return pool, nil
}

// withDatabase is url (a URL or a key/value connection string) naming database db.
func withDatabase(url, db string) string {
	if strings.HasPrefix(url, "postgres://") || strings.HasPrefix(url, "postgresql://") {
		rest := url[strings.Index(url, "://")+3:]
		q := ""
		if j := strings.Index(rest, "?"); j >= 0 {
			rest, q = rest[:j], rest[j:]
		}
		hostPart, _, _ := strings.Cut(rest, "/")
		return url[:strings.Index(url, "://")+3] + hostPart + "/" + db + q
	}
	return strings.TrimSpace(dbnameKV.ReplaceAllString(url, " ")) + " dbname=" + db
}

var dbnameKV = regexp.MustCompile(`(^|\s)dbname=('[^']*'|\S*)`)

// checkpoint flushes the dirty buffers so that a run does not pay for the previous one's.
func checkpoint(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, "CHECKPOINT")
	return err
}

// fieldsBlob is Fields as idem_begin stores them in request_fields (include/fields_blob.sql):
// for each field, in jsonb's key order (shorter names first, then bytewise), its name, a
// NUL byte and the first 8 bytes of its hash.
func fieldsBlob(fields map[string]string) []byte {
	names := make([]string, 0, len(fields))
	for n := range fields {
		names = append(names, n)
	}
	slices.SortFunc(names, func(a, b string) int {
		if c := cmp.Compare(len(a), len(b)); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	var out []byte
	for _, n := range names {
		h, _ := hex.DecodeString(fields[n][:16])
		out = append(out, n...)
		out = append(out, 0)
		out = append(out, h...)
	}
	return out
}

// checkFieldsBlob checks fieldsBlob against what idem_begin stores, in a transaction that is
// rolled back.
func checkFieldsBlob(ctx context.Context, conn *pgx.Conn) error {
	fp := canon.Compute("POST", path, []byte(`{"from":12,"to":345,"amount":6789}`))
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := dbidem.Begin(ctx, tx, dbidem.Claim{Principal: principal, Key: "fields-check", Action: action,
		Fingerprint: fp.Sum, Fields: fp.Fields}); err != nil {
		return err
	}
	var stored []byte
	if err := tx.QueryRow(ctx, `SELECT request_fields FROM idem.idempotency_keys WHERE principal_id = $1 AND key = 'fields-check'`,
		principal).Scan(&stored); err != nil {
		return err
	}
	if mine := fieldsBlob(fp.Fields); !bytes.Equal(stored, mine) {
		return fmt.Errorf("request_fields: the functions store %x, the hand-written variant would store %x", stored, mine)
	}
	return nil
}

// replayRequest is the request of completed key i (1..replayKeys): a UUID-shaped key and a
// transfer body of its own.
func replayRequest(i int) (key string, body []byte) {
	key = fmt.Sprintf("00000000-0000-4000-8000-%012d", i)
	body = fmt.Appendf(nil, `{"from":%d,"to":%d,"amount":1}`, i%accounts+1, (i*7)%accounts+1)
	return key, body
}

// insertReplayKeys stores replayKeys completed keys exactly as idem_begin and idem_complete
// would (state 'c', a fresh attempt, the action's hash, the fingerprint and field hashes of
// the request, the response), in one bulk INSERT.
func insertReplayKeys(ctx context.Context, conn *pgx.Conn) error {
	keys := make([]string, replayKeys)
	shas := make([][]byte, replayKeys)
	fields := make([][]byte, replayKeys)
	for i := range keys {
		key, body := replayRequest(i + 1)
		fp := canon.Compute("POST", path, body)
		keys[i], shas[i], fields[i] = key, fp.Sum[:], fieldsBlob(fp.Fields)
	}
	_, err := conn.Exec(ctx, `INSERT INTO idem.idempotency_keys
		  (expires_at, attempt, action_hash, state, principal_id, key, request_sha256, request_fields,
		   response_status, response_headers, response_body)
		SELECT now() + interval '30 days', nextval('idem.token_seq'), hashtextextended($1, 0), 'c', $2,
		       u.key, u.sha, u.fields, 201, $3::jsonb, $4
		  FROM unnest($5::text[], $6::bytea[], $7::bytea[]) AS u(key, sha, fields)`,
		action, principal, responseHeaderJSON, responseBody, keys, shas, fields)
	return err
}

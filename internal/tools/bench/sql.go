package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
)

// sqlVariant is one way to run the transfer: on which database, and one transaction.
type sqlVariant struct {
	name string
	db   string
	tx   func(ctx context.Context, pool *pgxpool.Pool, w *worker) error
}

var sqlVariants = []sqlVariant{
	{"nokey", "bench", noKeyTx},
	{"functions", "bench", functionsTx},
	{"nosavepoint", "bench", noSavepointTx},
	{"noguard", "bench_noguard", functionsTx},
	{"noset", "bench_noset", functionsTx},
	{"handwritten", "bench", handwrittenTx},
	{"seed001", "bench", seed001Tx},
	{"replay", "bench", replayTx},
	{"replaynoset", "bench_noset", replayTx},
}

// noKeyTx: BEGIN, the effect, COMMIT, as an application without keys sends them.
func noKeyTx(ctx context.Context, pool *pgxpool.Pool, w *worker) error {
	from, to := w.transfer()
	return inTx(ctx, pool, func(tx pgx.Tx) error { return effect(ctx, tx, from, to) })
}

// inTx runs fn in a transaction on a connection of pool, as an application sends it: BEGIN,
// fn's statements, COMMIT, each its own round trip.
func inTx(ctx context.Context, pool *pgxpool.Pool, fn func(tx pgx.Tx) error) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{})
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// effect is the money transfer: two statements, each its own round trip. tx is a pgx.Tx or
// a *dbidem.Tx.
func effect(ctx context.Context, tx pgx.Tx, from, to int) error {
	if _, err := tx.Exec(ctx, effectInsert, from, to); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, effectUpdate, to)
	return err
}

func claimOf(r request) dbidem.Claim {
	return dbidem.Claim{Principal: principal, Key: r.key, Action: action, Fingerprint: r.fp.Sum, Fields: r.fp.Fields}
}

var response = dbidem.Response{Status: 201, Header: responseHeader, Body: responseBody}

var errUnexpected = errors.New("unexpected outcome")

// functionsTx is the product's driver: RunTx, Claim (BEGIN + idem_begin + SAVEPOINT in one
// round trip), the effect, CompleteOnCommit (idem_complete + COMMIT in one round trip).
func functionsTx(ctx context.Context, pool *pgxpool.Pool, w *worker) error {
	r := w.request()
	return dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		d, err := tx.Claim(ctx, claimOf(r))
		if err != nil {
			return err
		}
		if d.Outcome != dbidem.Claimed {
			return fmt.Errorf("%w: %s", errUnexpected, d.Outcome)
		}
		if err := effect(ctx, tx, r.from, r.to); err != nil {
			return err
		}
		tx.CompleteOnCommit(response)
		return nil
	})
}

// noSavepointTx is functionsTx's pipeline built by hand without the savepoint: batch 1
// BEGIN + idem_begin, the effect, batch 2 idem_complete + COMMIT. It builds the arguments
// and reads the answer as the driver does.
func noSavepointTx(ctx context.Context, pool *pgxpool.Pool, w *worker) error {
	r := w.request()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	fields, _ := json.Marshal(r.fp.Fields)
	fieldsText := string(fields)
	var none *string
	var d decision
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(dbidem.BeginRecordSQL, principal, r.key, action, r.fp.Sum[:], none, none, &fieldsText, none).
		QueryRow(func(row pgx.Row) error { return row.Scan(d.record()) })
	br := conn.SendBatch(ctx, b)
	tx := br.Tx()
	if err := br.Close(); err != nil {
		_ = tx.Rollback(ctx)
		return err
	}
	if d.outcome != string(dbidem.Claimed) {
		_ = tx.Rollback(ctx)
		return fmt.Errorf("%w: %s", errUnexpected, d.outcome)
	}
	if err := effect(ctx, tx, r.from, r.to); err != nil {
		_ = tx.Rollback(ctx)
		return err
	}
	headers, _ := json.Marshal(map[string]string{"Content-Type": "application/json"})
	b = &pgx.Batch{}
	b.Queue(dbidem.CompleteSQL, principal, r.key, d.attempt, response.Status, string(headers), response.Body, none, none)
	b.Queue("COMMIT")
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		_ = tx.Rollback(ctx)
		return err
	}
	return nil
}

// decision is idem_begin's row as one record (dbidem.BeginRecordSQL), scanned into the types
// the driver scans it into.
type decision struct {
	outcome  string
	attempt  int64
	status   *int32
	headers  []byte
	body     []byte
	resource *string
	withheld *string
	changed  []string
	retry    pgtype.Interval
	provider *string
}

func (d *decision) record() pgtype.CompositeFields {
	return pgtype.CompositeFields{&d.outcome, &d.attempt, &d.status, &d.headers, &d.body, &d.resource, &d.withheld, &d.changed, &d.retry, &d.provider}
}

// handwrittenTx: our table, statements written by hand, each its own round trip.
func handwrittenTx(ctx context.Context, pool *pgxpool.Pool, w *worker) error {
	r := w.request()
	return inTx(ctx, pool, func(tx pgx.Tx) error { return handwritten(ctx, tx, r) })
}

func handwritten(ctx context.Context, tx pgx.Tx, r request) error {
	if _, err := tx.Exec(ctx, `DELETE FROM idem.idempotency_keys WHERE principal_id = $1 AND key = $2 AND expires_at <= now()`,
		principal, r.key); err != nil {
		return err
	}
	var attempt int64
	err := tx.QueryRow(ctx, `INSERT INTO idem.idempotency_keys
		  (expires_at, attempt, action_hash, state, uncompleted, principal_id, key, request_sha256, request_fields)
		VALUES (now() + interval '24 hours', nextval('idem.token_seq'), hashtextextended('POST /v1/transfers', 0), 'p', true,
		        $1, $2, $3, $4)
		ON CONFLICT DO NOTHING RETURNING attempt`,
		principal, r.key, r.fp.Sum[:], fieldsBlob(r.fp.Fields)).Scan(&attempt)
	if err != nil {
		return err
	}
	if err := effect(ctx, tx, r.from, r.to); err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `UPDATE idem.idempotency_keys
		   SET state = 'c', uncompleted = NULL, response_status = $3, response_headers = $4, response_body = $5
		 WHERE principal_id = $1 AND key = $2`,
		principal, r.key, response.Status, responseHeaderJSON, response.Body)
	return err
}

// seed001Tx: the seed tutorial's table and statements, each its own round trip.
func seed001Tx(ctx context.Context, pool *pgxpool.Pool, w *worker) error {
	r := w.request()
	return inTx(ctx, pool, func(tx pgx.Tx) error { return seed001(ctx, tx, r) })
}

func seed001(ctx context.Context, tx pgx.Tx, r request) error {
	const userID = 1
	if _, err := tx.Exec(ctx, `DELETE FROM seed_keys WHERE user_id = $1 AND key = $2 AND created_at < now() - interval '24 hours'`,
		userID, r.key); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO seed_keys (user_id, key, fingerprint, created_at) VALUES ($1,$2,$3, now()) ON CONFLICT DO NOTHING`,
		userID, r.key, r.fp.Sum[:]); err != nil {
		return err
	}
	if err := effect(ctx, tx, r.from, r.to); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `UPDATE seed_keys SET response_status = $3, response_body = $4 WHERE user_id = $1 AND key = $2`,
		userID, r.key, response.Status, response.Body)
	return err
}

// replayTx: the driver's Claim on one of the completed keys; RunTx then commits the
// read-only transaction.
func replayTx(ctx context.Context, pool *pgxpool.Pool, w *worker) error {
	key, body := replayRequest(w.rng.IntN(replayKeys) + 1)
	fp := canon.Compute("POST", path, body)
	return dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		d, err := tx.Claim(ctx, dbidem.Claim{Principal: principal, Key: key, Action: action, Fingerprint: fp.Sum, Fields: fp.Fields})
		if err != nil {
			return err
		}
		if d.Outcome != dbidem.Replay {
			return fmt.Errorf("%w: %s", errUnexpected, d.Outcome)
		}
		return nil
	})
}

// sqlPart runs every SQL variant on the loopback connection, round by round.
func sqlPart(ctx context.Context, b *bench) error {
	pools := map[string]*pgxpool.Pool{}
	defer func() {
		for _, p := range pools {
			p.Close()
		}
	}()
	variants := sqlVariants
	if only := os.Getenv("BENCH_SQL_VARIANTS"); only != "" {
		// For an A/B of some variants with more rounds; the rows of the others read n/a.
		variants = nil
		for _, v := range sqlVariants {
			if slices.Contains(strings.Split(only, ","), v.name) {
				variants = append(variants, v)
			}
		}
	}
	for _, v := range variants {
		if pools[v.db] != nil {
			continue
		}
		if err := b.database(ctx, v.db); err != nil {
			return err
		}
		p, err := openPool(ctx, b.url, v.db, b.clients, nil)
		if err != nil {
			return err
		}
		pools[v.db] = p
	}
	fmt.Printf("SQL: %d clients (pgx v5 pool, one connection each), %d rounds of %ds per variant, TCP loopback\n",
		b.clients, b.rounds, b.seconds)
	tps, fails, err := rounds(ctx, b, b.clients, variants, pools, "")
	if err != nil {
		return err
	}
	med := printMedians(variants, tps)
	b.ratio("SQL: functions / seed 001 statements (loopback)", med["functions"]/med["seed001"], ">=", 1.00)
	b.ratio("SQL: functions / hand-written on our table", med["functions"]/med["handwritten"], ">=", 1.05)
	b.ratio("SQL: guard / no guard", med["functions"]/med["noguard"], ">=", 0.95)
	b.ratio("SQL: functions with savepoint / without", med["functions"]/med["nosavepoint"], "", 0)
	b.ratio("SQL: functions with their SET clauses / without", med["functions"]/med["noset"], "", 0)
	b.ratio("SQL: replay with the SET clauses / without", med["replay"]/med["replaynoset"], "", 0)
	b.ratio("SQL: replay / first execution", med["replay"]/med["functions"], ">=", 3.00)
	b.ratio("SQL: functions / no key", med["functions"]/med["nokey"], "", 0)
	b.ratio("SQL: seed 001 / no key", med["seed001"]/med["nokey"], "", 0)
	return fails.err()
}

// rounds runs the variants round by round (a CHECKPOINT before each run) and returns the
// committed transactions per second of every run, by variant, and the failed transactions
// (any: the variants never fail by design).
func rounds(ctx context.Context, b *bench, clients int, variants []sqlVariant, pools map[string]*pgxpool.Pool, label string) (map[string][]float64, *failures, error) {
	tps := map[string][]float64{}
	fails := &failures{}
	for r := 1; r <= b.rounds; r++ {
		for _, v := range variants {
			pool := pools[v.db]
			if err := checkpoint(ctx, pool); err != nil {
				return nil, nil, err
			}
			res := drive(ctx, clients, after(time.Duration(b.seconds)*time.Second),
				func(ctx context.Context, w *worker) error { return v.tx(ctx, pool, w) })
			if ctx.Err() != nil {
				return nil, nil, ctx.Err()
			}
			fails.add(v.name, res)
			tps[v.name] = append(tps[v.name], res.rate())
			fmt.Printf("  round %d  %s%-12s %8.0f tps%s\n", r, label, v.name, res.rate(), res.errNote())
		}
	}
	return tps, fails, nil
}

// failures counts the failed transactions or requests of a part's runs.
type failures struct {
	n     int
	first string
}

func (f *failures) add(variant string, r result) {
	if r.errors > 0 && f.n == 0 {
		f.first = variant + ": " + firstLine(r.firstErr.Error())
	}
	f.n += r.errors
}

// err is nil, or an error that says how many failed and how the first did.
func (f *failures) err() error {
	if f.n == 0 {
		return nil
	}
	return fmt.Errorf("%d transactions or requests failed; the first: %s", f.n, f.first)
}

// printMedians prints each variant's median and its runs, and returns the medians.
func printMedians(variants []sqlVariant, tps map[string][]float64) map[string]float64 {
	med := map[string]float64{}
	fmt.Printf("\n%-12s %10s   %s\n", "variant", "median tps", "runs")
	for _, v := range variants {
		med[v.name] = median(tps[v.name])
		fmt.Printf("%-12s %10.0f   %v\n", v.name, med[v.name], rounded(tps[v.name]))
	}
	return med
}

package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/client"
	"github.com/pgidem/pgidem/internal/dbidem"
	idemsql "github.com/pgidem/pgidem/sql"
)

const (
	// scalePrincipals send the scale part's keys, each as many.
	scalePrincipals = 10_000
	// scaleClients drive the scale part.
	scaleClients = 8
	// scaleSmall is the small table's size: make bench's other parts run on 100,000 keys.
	scaleSmall = 100_000
)

// scaleVariant is one run of the scale part: a table, the session's wal_compression, and
// whether the clients' keys are time-ordered (UUIDv7, as idemclient makes them) or random
// (UUIDv4).
type scaleVariant struct {
	name, db, walCompression string
	v7                       bool
}

// The scale part's databases: random keys and time-ordered keys, each small and large.
const (
	scaleSmallDB   = "bench_scale_small"
	scaleLargeDB   = "bench_scale_large"
	scaleSmallV7DB = "bench_scale_small_v7"
	scaleLargeV7DB = "bench_scale_large_v7"
)

// scalePart measures claim + complete of fresh random keys (UUIDv4 of scalePrincipals
// principals, no effect) on a large key table (BENCH_SCALE_KEYS, 10 million) against the same
// on a small one, each run starting at a checkpoint, and the WAL written per transaction; the
// large table again with wal_compression=lz4, the operator's lever against full-page images;
// and the same small and large comparison on tables filled with, and claimed with,
// time-ordered keys (UUIDv7).
func scalePart(ctx context.Context, b *bench) error {
	large := b.scaleKeys
	type table struct {
		n  int
		v7 bool
	}
	dbs := map[string]table{scaleSmallDB: {scaleSmall, false}, scaleLargeDB: {large, false},
		scaleSmallV7DB: {scaleSmall, true}, scaleLargeV7DB: {large, true}}
	for _, db := range []string{scaleSmallDB, scaleLargeDB, scaleSmallV7DB, scaleLargeV7DB} {
		if err := b.scaleDatabase(ctx, db, dbs[db].n, dbs[db].v7); err != nil {
			return err
		}
	}
	variants := []scaleVariant{
		{"small", scaleSmallDB, "off", false},
		{"large", scaleLargeDB, "off", false},
		{"large lz4", scaleLargeDB, "lz4", false},
		{"small v7", scaleSmallV7DB, "off", true},
		{"large v7", scaleLargeV7DB, "off", true},
	}
	pools := map[string]*pgxpool.Pool{}
	for _, v := range variants {
		p, err := openPool(ctx, b.url, v.db, scaleClients, func(c *pgxpool.Config) {
			c.ConnConfig.RuntimeParams["wal_compression"] = v.walCompression
		})
		if err != nil {
			return fmt.Errorf("%s: %w (wal_compression=lz4 needs a server built with lz4)", v.name, err)
		}
		defer p.Close()
		pools[v.name] = p
	}
	for _, v := range variants {
		if v.walCompression != "off" {
			continue
		}
		var idx, heap int64
		if err := pools[v.name].QueryRow(ctx,
			`SELECT pg_relation_size('idem.idempotency_keys_pkey'), pg_relation_size('idem.idempotency_keys')`).Scan(&idx, &heap); err != nil {
			return err
		}
		fmt.Printf("%s: %d keys, table %d MiB, primary key %d MiB (%.0f 8 KiB pages)\n", v.db, dbs[v.db].n, heap>>20, idx>>20, float64(idx)/8192)
	}
	fmt.Printf("scale: claim + complete of fresh keys (UUIDv4, or UUIDv7 in the v7 variants) of %d principals (no effect), %d clients, %d rounds of %ds per variant, each run after a CHECKPOINT\n",
		scalePrincipals, scaleClients, b.rounds, b.seconds)
	tps := map[string][]float64{}
	wal := map[string][]float64{}
	makeUp := map[string][]float64{} // "variant/part": bytes per transaction, by run
	var fails failures
	for r := 1; r <= b.rounds; r++ {
		for _, v := range variants {
			pool := pools[v.name]
			if err := checkpoint(ctx, pool); err != nil {
				return err
			}
			var lsn0 string
			if err := pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn0); err != nil {
				return err
			}
			res := drive(ctx, scaleClients, after(time.Duration(b.seconds)*time.Second), func(ctx context.Context, w *worker) error {
				return scaleTx(ctx, pool, w, v.v7)
			})
			if ctx.Err() != nil {
				return ctx.Err()
			}
			var walBytes float64
			if err := pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)`, lsn0).Scan(&walBytes); err != nil {
				return err
			}
			fails.add(v.name, res)
			n := float64(max(res.n, 1))
			perTx := walBytes / n
			tps[v.name] = append(tps[v.name], res.rate())
			wal[v.name] = append(wal[v.name], perTx)
			fmt.Printf("  round %d  %-10s %6.0f tps, %6.0f WAL bytes/tx%s\n", r, v.name, res.rate(), perTx, res.errNote())
			m, err := walMakeUpOf(ctx, pool, lsn0)
			if err != nil {
				return fmt.Errorf("the WAL's make-up (pg_walinspect): %w", err)
			}
			for k, x := range m {
				makeUp[v.name+"/"+k] = append(makeUp[v.name+"/"+k], x/n)
			}
			fmt.Printf("             records: heap %.0f, index %.0f, commit %.0f, other %.0f; full-page images %.0f (bytes/tx)\n",
				m["heap"]/n, m["index"]/n, m["commit"]/n, m["other"]/n, m["fpi"]/n)
		}
	}
	fmt.Printf("\n%-10s %10s %14s   %s\n", "variant", "median tps", "WAL bytes/tx", "runs")
	med, medWAL := map[string]float64{}, map[string]float64{}
	for _, v := range variants {
		med[v.name], medWAL[v.name] = median(tps[v.name]), median(wal[v.name])
		fmt.Printf("%-10s %10.0f %14.0f   %v\n", v.name, med[v.name], medWAL[v.name], rounded(tps[v.name]))
	}
	name := fmt.Sprintf("scale: claim+complete, %s keys / %s keys", millions(large), millions(scaleSmall))
	b.ratio(name+", time-ordered keys (UUIDv7)", med["large v7"]/med["small v7"], ">=", 0.95)
	b.ratio(name+", random keys (UUIDv4), the worst case", med["large"]/med["small"], ">=", 0.90)
	b.ratio(name+", random keys, wal_compression=lz4", med["large lz4"]/med["small"], "", 0)
	b.info("scale: WAL bytes/tx small, large, large lz4, small v7, large v7", fmt.Sprintf("%.0f %.0f %.0f %.0f %.0f",
		medWAL["small"], medWAL["large"], medWAL["large lz4"], medWAL["small v7"], medWAL["large v7"]))
	// The WAL a keyed request writes beyond its response body: its records (the claim's
	// insert and index entries, the completion's HOT update, the commit) without the
	// full-page images, which each run pays anew after its CHECKPOINT (once per page touched
	// in the run) and a server pays once per page per checkpoint interval.
	body := float64(len(responseBody) + len(responseHeaderJSON))
	records := func(v string) float64 {
		return median(makeUp[v+"/heap"]) + median(makeUp[v+"/index"]) + median(makeUp[v+"/commit"]) + median(makeUp[v+"/other"])
	}
	b.check(fmt.Sprintf("scale: WAL bytes per keyed request beyond its response, records, time-ordered keys, %s keys", millions(large)),
		fmt.Sprintf("%.0f", records("large v7")-body), records("large v7")-body, "<=", 1024, "%.0f")
	for _, v := range []string{"large v7", "large"} {
		b.info(fmt.Sprintf("scale: WAL make-up, %s: heap, index, commit, other, full-page images (bytes/tx)", v),
			fmt.Sprintf("%.0f %.0f %.0f %.0f %.0f", median(makeUp[v+"/heap"]), median(makeUp[v+"/index"]),
				median(makeUp[v+"/commit"]), median(makeUp[v+"/other"]), median(makeUp[v+"/fpi"])))
	}
	return fails.err()
}

// millions writes n keys shortly: 100k, 10M.
func millions(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return fmt.Sprintf("%dM", n/1_000_000)
	case n >= 1000 && n%1000 == 0:
		return fmt.Sprintf("%dk", n/1000)
	}
	return fmt.Sprint(n)
}

// scaleTx claims a fresh key of a random principal and completes it, nothing else: a random
// key, or a time-ordered one as idemclient makes it (v7).
func scaleTx(ctx context.Context, pool *pgxpool.Pool, w *worker, v7 bool) error {
	r := w.request()
	if v7 {
		r.key = client.NewKey()
	}
	c := dbidem.Claim{Principal: fmt.Sprintf("p%05d", w.rng.IntN(scalePrincipals)+1), Key: r.key, Action: action,
		Fingerprint: r.fp.Sum, Fields: r.fp.Fields}
	return dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		d, err := tx.Claim(ctx, c)
		if err != nil {
			return err
		}
		if d.Outcome != dbidem.Claimed {
			return fmt.Errorf("%w: %s", errUnexpected, d.Outcome)
		}
		tx.CompleteOnCommit(response)
		return nil
	})
}

// scaleDatabase creates db with n completed keys of scalePrincipals principals, as idem_begin
// and idem_complete store them, inserted in the primary key's order (a bulk load). The keys are
// random UUIDv4 (the runs then insert at random places, as clients do), or with v7
// time-ordered UUIDv7 of the last 24 hours, a chunk's keys later than the chunk before (the
// runs' keys, made now, then go at the end of their principal's keys, as clients' do).
func (b *bench) scaleDatabase(ctx context.Context, db string, n int, v7 bool) error {
	if b.ready[db] {
		return nil
	}
	t0 := time.Now()
	kind := "random UUIDv4"
	if v7 {
		kind = "time-ordered UUIDv7"
	}
	fmt.Printf("setting up database %s: the idem schema, %d completed keys (%s) of %d principals\n", db, n, kind, scalePrincipals)
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
	fp := canon.Compute("POST", path, []byte(`{"from":1,"to":2,"amount":1}`))
	// Loaded at fillfactor 100, so that no loaded page keeps room for one more row: the
	// runs' claims then go where a production table's go, into pages of their own (there, the
	// pages cleanup emptied), not each into a random old page that the free space map offers
	// (which would read a random heap page per claim: 8,560 reads in 8,560 claims, measured).
	if _, err := conn.Exec(ctx, `ALTER TABLE idem.idempotency_keys SET (fillfactor = 100)`); err != nil {
		return err
	}
	// A UUIDv7 (RFC 9562) of time t as text, in the layout idemclient writes: 48 bits of Unix
	// milliseconds, the version, 12 random bits, the variant, 62 random bits.
	if _, err := conn.Exec(ctx, `CREATE FUNCTION idem_bench_uuidv7(t timestamptz) RETURNS text LANGUAGE sql AS $f$
		SELECT substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(r, 1, 3) || '-' ||
		       to_hex(8 + (random() * 3)::int) || substr(r, 4, 3) || '-' || substr(r, 7, 12)
		  FROM (SELECT lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') AS h,
		               md5(random()::text) AS r) AS x $f$`); err != nil {
		return err
	}
	const chunk = 1_000_000
	for done := 0; done < n; done += chunk {
		m := min(chunk, n-done)
		if _, err := conn.Exec(ctx, `SET maintenance_work_mem = '512MB'`); err != nil {
			return err
		}
		if _, err := conn.Exec(ctx, `SET work_mem = '512MB'`); err != nil {
			return err
		}
		// Each chunk's keys are sorted; chunks interleave in the index, as a table filled
		// over time does.
		if _, err := conn.Exec(ctx, `INSERT INTO idem.idempotency_keys
			  (expires_at, attempt, action_hash, state, principal_id, key, request_sha256, request_fields,
			   response_status, response_headers, response_body)
			SELECT now() + interval '1 day', nextval('idem.token_seq'), hashtextextended($1, 0), 'c', s.p, s.k,
			       $2, $3, 201, $4::jsonb, $5
			  FROM (SELECT format('p%s', lpad((1 + (random() * ($6::integer - 1))::integer)::text, 5, '0')) AS p,
			               CASE WHEN $8 THEN idem_bench_uuidv7(
			                   now() - interval '1 day' * (1 - ($9::float8 + random() * $7::integer) / $10::float8))
			                    ELSE gen_random_uuid()::text END AS k
			          FROM generate_series(1, $7::integer)) AS s
			 ORDER BY s.p, s.k`,
			action, fp.Sum[:], fieldsBlob(fp.Fields), responseHeaderJSON, responseBody, scalePrincipals, m,
			v7, float64(done), float64(n)); err != nil {
			return fmt.Errorf("%s: insert keys: %w", db, err)
		}
		if n > chunk {
			fmt.Printf("  %d keys (%s)\n", done+m, time.Since(t0).Round(time.Second))
		}
	}
	if _, err := conn.Exec(ctx, `ALTER TABLE idem.idempotency_keys SET (fillfactor = 95)`); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, `VACUUM (FREEZE, ANALYZE) idem.idempotency_keys`); err != nil {
		return err
	}
	// The runs find the table as a long-running server does: read since the last restart
	// (pg_prewarm is an extension the server may not have; a sequential read warms the OS
	// cache, and the index is read by the runs themselves).
	var count int64
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM idem.idempotency_keys`).Scan(&count); err != nil {
		return err
	}
	if count != int64(n) {
		return fmt.Errorf("%s: %d keys, want %d", db, count, n)
	}
	fmt.Printf("  %s ready (%s)\n", db, time.Since(t0).Round(time.Second))
	b.ready[db] = true
	return nil
}

// walMakeUpOf is what the WAL from lsn0 to now is made of, in bytes: the records of the heap
// (Heap, Heap2), of the indexes (Btree), of commits (Transaction) and of the rest, and the
// full-page images of all (pg_walinspect, which the bench's superuser creates).
func walMakeUpOf(ctx context.Context, pool *pgxpool.Pool, lsn0 string) (map[string]float64, error) {
	if _, err := pool.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_walinspect`); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `SELECT pg_switch_wal()`); err != nil { // the end must be flushed
		return nil, err
	}
	rows, err := pool.Query(ctx, `SELECT split_part("resource_manager/record_type", '/', 1), sum(record_size), sum(fpi_size)
		  FROM pg_get_wal_stats($1::pg_lsn, pg_current_wal_flush_lsn(), true)
		 WHERE "resource_manager/record_type" NOT LIKE 'XLOG/SWITCH%'
		 GROUP BY 1`, lsn0)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	m := map[string]float64{}
	for rows.Next() {
		var rm string
		var rec, fpi float64
		if err := rows.Scan(&rm, &rec, &fpi); err != nil {
			return nil, err
		}
		part := map[string]string{"Heap": "heap", "Heap2": "heap", "Btree": "index", "Transaction": "commit"}[rm]
		if part == "" {
			part = "other"
		}
		m[part] += rec
		m["fpi"] += fpi
	}
	return m, rows.Err()
}

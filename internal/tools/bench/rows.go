package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/client"
	"github.com/pgidem/pgidem/internal/dbidem"
)

// diskKeys is how many keys the on-disk size is measured over.
const diskKeys = 50_000

// serverRequest is a request and response like the reference server's POST /v1/transfers:
// a 3-field body, a UUID key, 201 with Content-Type and Location, the transfer as JSON.
func serverRequest(rng *rand.Rand, owner string, id int) (dbidem.Claim, dbidem.Response) {
	body := fmt.Appendf(nil, `{"from":%d,"to":%d,"amount":%d}`, rng.IntN(10_000)+1, rng.IntN(10_000)+1, rng.IntN(100_000)+1)
	var in struct{ From, To, Amount int64 }
	_ = json.Unmarshal(body, &in)
	fp := canon.Compute("POST", path, body)
	created := time.Date(2026, 11, 30, 2, 41, 7, 123456000, time.UTC).Add(time.Duration(id) * time.Millisecond)
	// The server's transfer type (cmd/server/ledger.go), field for field.
	out, _ := json.Marshal(struct {
		ID        int64     `json:"id"`
		From      int64     `json:"from"`
		To        int64     `json:"to"`
		Amount    int64     `json:"amount"`
		CreatedAt time.Time `json:"created_at"`
	}{int64(id), in.From, in.To, in.Amount, created})
	out = append(out, '\n') // the server's json.Encoder ends the body with a newline
	return dbidem.Claim{Principal: owner, Key: client.NewKey(), Action: action, Fingerprint: fp.Sum, Fields: fp.Fields},
		dbidem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}, "Location": {fmt.Sprintf("/v1/transfers/%d", id)}},
			Body: out}
}

// rowsPart measures what a key stores beyond its response, and the key table's size on disk.
func rowsPart(ctx context.Context, b *bench) error {
	if err := b.database(ctx, "bench_rows"); err != nil {
		return err
	}
	pool, err := openPool(ctx, b.url, "bench_rows", 2, nil)
	if err != nil {
		return err
	}
	defer pool.Close()
	rng := newRand()
	owner := fmt.Sprintf("p_%016x", rng.Uint64()) // like the server's principal ids

	claim, resp := serverRequest(rng, owner, 1)
	key := claim.Key
	err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		d, err := tx.Claim(ctx, claim)
		if err != nil {
			return err
		}
		if d.Outcome != dbidem.Claimed {
			return fmt.Errorf("%w: %s", errUnexpected, d.Outcome)
		}
		tx.CompleteOnCommit(resp)
		return nil
	})
	if err != nil {
		return err
	}
	var beyond, tuple, bodySize, headerSize int
	if err := pool.QueryRow(ctx, `SELECT pg_column_size(k.*) - coalesce(pg_column_size(response_body), 0)
		                                 - coalesce(pg_column_size(response_headers), 0),
		       pg_column_size(k.*), coalesce(pg_column_size(response_body), 0), coalesce(pg_column_size(response_headers), 0)
		  FROM idem.idempotency_keys k WHERE principal_id = $1 AND key = $2`, owner, key).
		Scan(&beyond, &tuple, &bodySize, &headerSize); err != nil {
		return err
	}
	fmt.Printf("one key (principal %s, key %s, 3 fields): tuple %d bytes = %d beyond the response + body %d + headers %d\n",
		owner, key, tuple, beyond, bodySize, headerSize)

	t0 := time.Now()
	if err := claimMany(ctx, pool, owner, rng, 2, diskKeys-1); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE idem.idempotency_keys`); err != nil {
		return err
	}
	var n, total int64
	if err := pool.QueryRow(ctx, `SELECT count(*), pg_total_relation_size('idem.idempotency_keys') FROM idem.idempotency_keys`).
		Scan(&n, &total); err != nil {
		return err
	}
	fmt.Printf("%d such keys (claimed and completed through the functions in %s), VACUUM ANALYZE: %d bytes in all\n",
		n, time.Since(t0).Round(100*time.Millisecond), total)
	b.check("stored bytes per key beyond the response body and headers", fmt.Sprint(beyond), float64(beyond), "<=", 200, "%.0f")
	b.info("stored bytes per key, whole tuple", fmt.Sprint(tuple))
	b.info(fmt.Sprintf("bytes per key on disk (table and indexes, %d keys, after VACUUM ANALYZE)", n), fmt.Sprint(total/n))
	return nil
}

// claimMany claims and completes n keys like serverRequest's through idem_begin and
// idem_complete (the driver's statements), 250 per transaction, on two connections.
func claimMany(ctx context.Context, pool *pgxpool.Pool, owner string, rng *rand.Rand, firstID, n int) error {
	const perTx = 250
	type job struct {
		claims []dbidem.Claim
		resps  []dbidem.Response
	}
	jobs := make(chan job)
	errs := make(chan error, 2)
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				if err := claimBatch(ctx, pool, j.claims, j.resps); err != nil {
					errs <- err
					for range jobs {
					}
					return
				}
			}
		}()
	}
	for i := 0; i < n; i += perTx {
		var j job
		for k := i; k < min(i+perTx, n); k++ {
			c, r := serverRequest(rng, owner, firstID+k)
			j.claims, j.resps = append(j.claims, c), append(j.resps, r)
		}
		jobs <- j
	}
	close(jobs)
	wg.Wait()
	close(errs)
	return <-errs
}

// claimBatch claims and completes the keys in one transaction: BEGIN and every idem_begin
// in one pipeline, then every idem_complete and COMMIT in another.
func claimBatch(ctx context.Context, pool *pgxpool.Pool, claims []dbidem.Claim, resps []dbidem.Response) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	var none *string
	ds := make([]decision, len(claims))
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	for i, c := range claims {
		fields, _ := json.Marshal(c.Fields)
		b.Queue(dbidem.BeginRecordSQL, c.Principal, c.Key, c.Action, c.Fingerprint[:], none, none, string(fields), none).
			QueryRow(func(row pgx.Row) error { return row.Scan(ds[i].record()) })
	}
	br := conn.SendBatch(ctx, b)
	tx := br.Tx()
	if err := br.Close(); err != nil {
		_ = tx.Rollback(ctx)
		return err
	}
	b = &pgx.Batch{}
	for i, c := range claims {
		h := map[string]string{}
		for k, v := range resps[i].Header {
			h[k] = v[0]
		}
		headers, _ := json.Marshal(h)
		b.Queue(dbidem.CompleteSQL, c.Principal, c.Key, ds[i].attempt, resps[i].Status, string(headers), resps[i].Body, none, none)
	}
	b.Queue("COMMIT")
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		_ = tx.Rollback(ctx)
		return err
	}
	return nil
}

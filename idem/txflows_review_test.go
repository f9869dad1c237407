package idem_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestTxLegitimateFlows: flows a handler or a Do's fn uses that end no transaction must
// still commit after D195's ended() checks.
func TestTxLegitimateFlows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE rv_t (k text PRIMARY KEY)`)
	flows := map[string]func(ctx context.Context, tx pgx.Tx, key string) error{
		"sql savepoint after failure": func(ctx context.Context, tx pgx.Tx, key string) error {
			if _, err := tx.Exec(ctx, `SAVEPOINT a`); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `SELECT 1/0`); err == nil {
				t.Error("1/0 did not fail")
			}
			if _, err := tx.Exec(ctx, `ROLLBACK TO SAVEPOINT a`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO rv_t VALUES ($1)`, key)
			return err
		},
		"nested begin rollback": func(ctx context.Context, tx pgx.Tx, key string) error {
			n, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := n.Exec(ctx, `SELECT 1/0`); err == nil {
				t.Error("1/0 did not fail")
			}
			if err := n.Rollback(ctx); err != nil {
				return err
			}
			n2, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := n2.Exec(ctx, `INSERT INTO rv_t VALUES ($1)`, key); err != nil {
				return err
			}
			return n2.Commit(ctx)
		},
		"copyfrom and batch": func(ctx context.Context, tx pgx.Tx, key string) error {
			if _, err := tx.CopyFrom(ctx, pgx.Identifier{"rv_t"}, []string{"k"}, pgx.CopyFromRows([][]any{{key + "-c"}})); err != nil {
				return err
			}
			b := &pgx.Batch{}
			b.Queue(`INSERT INTO rv_t VALUES ($1)`, key)
			b.Queue(`SELECT 1`)
			return tx.SendBatch(ctx, b).Close()
		},
		"large objects and conn": func(ctx context.Context, tx pgx.Tx, key string) error {
			lo := tx.LargeObjects()
			if _, err := lo.Create(ctx, 0); err != nil {
				return err
			}
			if _, err := tx.Conn().Exec(ctx, `INSERT INTO rv_t VALUES ($1)`, key); err != nil {
				return err
			}
			return nil
		},
		"prepared": func(ctx context.Context, tx pgx.Tx, key string) error {
			if _, err := tx.Prepare(ctx, "txins", `INSERT INTO rv_t VALUES ($1)`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "txins", key)
			return err
		},
		"sql savepoint release": func(ctx context.Context, tx pgx.Tx, key string) error {
			if _, err := tx.Exec(ctx, `SAVEPOINT a; INSERT INTO rv_t VALUES ('`+key+`'); RELEASE SAVEPOINT a`); err != nil {
				return err
			}
			return nil
		},
	}
	for name, f := range flows {
		t.Run(name, func(t *testing.T) {
			key := "k-" + strings.ReplaceAll(name, " ", "_")
			_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: key, Action: "a"}, idem.TxOptions{},
				func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, f(ctx, tx, key) })
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM rv_t WHERE k = $1`, key); n != 1 {
				t.Fatalf("%s: %d rows", name, n)
			}
			v, replayed, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: key, Action: "a"}, idem.TxOptions{},
				func(ctx context.Context, tx pgx.Tx) (int, error) { return 2, nil })
			if err != nil || !replayed || v != 1 {
				t.Fatalf("%s: repeat %d %v %v", name, v, replayed, err)
			}
		})
	}
}

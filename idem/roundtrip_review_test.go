package idem_test

import (
	"context"
	"encoding/json"
	"math"
	"math/big"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

type rtPage struct {
	Items []string       `json:"items,omitempty"`
	Meta  map[string]int `json:"meta,omitempty"`
}

type rtOrder struct {
	ID int `json:"id"`
}

type rtOrders struct {
	Orders []rtOrder `json:"orders,omitempty"`
}

type rtWhen struct {
	At time.Time `json:"at,omitzero"`
}

type rtEmbedBase struct{ A int }
type rtEmbed struct {
	rtEmbedBase
	B *int `json:"b,omitempty"`
}

// TestRoundTripLegitimateResults: results that replay exactly as their JSON says must not be
// refused by D195's round-trip check; its first version refused a struct whose omitempty
// fields were empty but not nil (what pgx.CollectRows gives for no rows) and an omitzero time
// with a zone. Each runs Do once and expects success and no error.
func TestRoundTripLegitimateResults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	run := func(t *testing.T, key string, v any) {
		t.Helper()
		_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: key, Action: "a"}, idem.TxOptions{},
			func(ctx context.Context, tx pgx.Tx) (any, error) { return v, nil })
		if err != nil {
			t.Errorf("%s (%T): %v", key, v, err)
		}
	}
	runT := func(t *testing.T, key string, f func() error) {
		t.Helper()
		if err := f(); err != nil {
			t.Errorf("%s: %v", key, err)
		}
	}
	loc, _ := time.LoadLocation("Asia/Kathmandu")
	ams, _ := time.LoadLocation("Europe/Amsterdam")
	t.Run("any values", func(t *testing.T) {
		run(t, "f1", 1e21)
		run(t, "f2", 5e-324)
		run(t, "f3", math.Copysign(0, -1))
		run(t, "nested", map[string]any{"a": []any{1.5, "x", map[string]any{"b": nil}}})
		run(t, "num", json.Number("12"))
		run(t, "bytes", []byte{0, 1, 2, 255})
		run(t, "mapint", map[int]string{1: "a", 10: "b", 2: "c"})
		run(t, "time", time.Date(2024, 1, 2, 3, 4, 5, 6, loc))
		run(t, "timeams", time.Date(1920, 1, 2, 3, 4, 5, 6, ams))
		run(t, "float32", float32(0.1))
	})
	do := func(key string, v rtPage) func() error {
		return func() error {
			_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: key, Action: "a"}, idem.TxOptions{},
				func(ctx context.Context, tx pgx.Tx) (rtPage, error) { return v, nil })
			return err
		}
	}
	t.Run("omitempty empty slice", func(t *testing.T) {
		runT(t, "emptyslice", do("emptyslice", rtPage{Items: []string{}}))
	})
	t.Run("omitempty empty map", func(t *testing.T) {
		runT(t, "emptymap", do("emptymap", rtPage{Meta: map[string]int{}}))
	})
	t.Run("CollectRows of no rows", func(t *testing.T) {
		runT(t, "collect", func() error {
			_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "collect", Action: "a"}, idem.TxOptions{},
				func(ctx context.Context, tx pgx.Tx) (rtOrders, error) {
					rows, _ := tx.Query(ctx, `SELECT 1 AS id WHERE false`)
					orders, err := pgx.CollectRows(rows, pgx.RowToStructByName[rtOrder])
					return rtOrders{Orders: orders}, err
				})
			return err
		})
	})
	t.Run("omitzero time with a zone", func(t *testing.T) {
		runT(t, "omitzero", func() error {
			_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "omitzero", Action: "a"}, idem.TxOptions{},
				func(ctx context.Context, tx pgx.Tx) (rtWhen, error) { return rtWhen{At: time.Time{}.In(loc)}, nil })
			return err
		})
	})
	t.Run("typed", func(t *testing.T) {
		runT(t, "bigint", func() error {
			b, _ := new(big.Int).SetString("123456789012345678901234567890", 10)
			_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "bigint", Action: "a"}, idem.TxOptions{},
				func(ctx context.Context, tx pgx.Tx) (*big.Int, error) { return b, nil })
			return err
		})
		runT(t, "embed", func() error {
			_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "embed", Action: "a"}, idem.TxOptions{},
				func(ctx context.Context, tx pgx.Tx) (rtEmbed, error) {
					return rtEmbed{rtEmbedBase: rtEmbedBase{A: 3}}, nil
				})
			return err
		})
	})
}

// TestInputWithEmptyOmittedSlice: a Job.Input struct whose only non-zero field is an empty
// (non-nil) slice tagged omitempty encodes as {}; D195's first check for an Input that
// "exports none of its fields" refused it, though its fields are exported and every value of
// it fingerprints by its JSON. The check looks at the type's fields now.
func TestInputWithEmptyOmittedSlice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 2)
	in := rtPage{Items: []string{}}
	_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "in1", Action: "a", Input: in}, idem.TxOptions{},
		func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil })
	if err != nil {
		t.Fatalf("Input %#v: %v; want it accepted (its JSON {} is what a nil slice gives too)", in, err)
	}
}

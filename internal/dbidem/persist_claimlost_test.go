package dbidem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// unreadable is a Querier on which every statement fails at once, as on a connection that
// cannot be had.
type unreadable struct{}

var errUnreadable = errors.New("no connection")

func (unreadable) QueryRow(context.Context, string, ...any) pgx.Row { return errRow{} }
func (unreadable) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, errUnreadable
}

type errRow struct{}

func (errRow) Scan(...any) error { return errUnreadable }

// PersistAnswer reads the key's row whenever a try says the claim is lost (D271). Where every
// try was answered and the read gets no answer, the try's ErrClaimLost stands, at once: the
// read is bounded on its own (a second), not by the caller's deadline, which a lease route's
// answer also needs for what follows (D249's SaveFinal). A review found it waiting out the
// whole deadline and a second more.
func TestPersistAnswerClaimLostWithoutAReadIsPrompt(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	c := dbidem.Claim{Principal: "p", Key: "lost-unread", Action: "payout", Fingerprint: [32]byte{9}, Lease: 30 * time.Second}
	d, err := dbidem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	if ok, err := dbidem.Release(ctx, pool, c.Principal, c.Key, d.Attempt); !ok || err != nil {
		t.Fatalf("release: %v %v", ok, err)
	}
	pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	start := time.Now()
	err = dbidem.PersistAnswer(pctx, pool, unreadable{}, c, d.Attempt, dbidem.Response{Status: 201})
	took := time.Since(start)
	if !errors.Is(err, dbidem.ErrClaimLost) || took > 5*time.Second {
		t.Errorf("PersistAnswer of a released claim whose row cannot be read: %v after %s; want ErrClaimLost within about a second", err, took)
	}
	if pctx.Err() != nil {
		t.Errorf("the caller's deadline passed: PersistAnswer took it all")
	}
}

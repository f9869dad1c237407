package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
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

// loseFirstReply is a Querier on pool whose first Exec runs, commits, and then reports the
// connection closed, as when the reply of a Complete that landed was lost on the way.
type loseFirstReply struct {
	pool interface {
		dbidem.Querier
	}
	lost bool
}

func (l *loseFirstReply) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return l.pool.QueryRow(ctx, sql, args...)
}

func (l *loseFirstReply) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := l.pool.Exec(ctx, sql, args...)
	if err == nil && !l.lost {
		l.lost = true
		return pgconn.CommandTag{}, fmt.Errorf("reading the reply: %w", pgconn.ErrConnClosed)
	}
	return tag, err
}

// A Complete whose reply was lost (it landed), a next try told the claim is no longer in
// progress, and a key's row that no read can get by the deadline: PersistAnswer cannot know
// whether the answer is stored, and says so. ErrClaimLost would say another attempt holds the
// key, and a lease route would answer 409 for work that is done (D271).
func TestPersistAnswerLostReplyWithoutAReadIsUnknown(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	c := dbidem.Claim{Principal: "p", Key: "lost-reply-unread", Action: "payout", Fingerprint: [32]byte{7}, Lease: 30 * time.Second}
	d, err := dbidem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	pctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	start := time.Now()
	err = dbidem.PersistAnswer(pctx, &loseFirstReply{pool: pool}, unreadable{}, c, d.Attempt, dbidem.Response{Status: 201})
	took := time.Since(start)
	if err == nil || errors.Is(err, dbidem.ErrClaimLost) || !strings.Contains(err.Error(), "could not be read") {
		t.Errorf("PersistAnswer after a lost reply, with the row unreadable: %v; want an error saying whether it landed could not be read, not ErrClaimLost", err)
	}
	if took > 10*time.Second {
		t.Errorf("PersistAnswer took %s past a deadline of a second", took)
	}
	if k, ok, err := dbidem.ReadKey(ctx, pool, c.Principal, c.Key); err != nil || !ok || k.State != "completed" || k.Attempt != d.Attempt {
		t.Fatalf("the key's row: %+v %v %v; want completed with attempt %d (the lost reply's Complete landed)", k, ok, err, d.Attempt)
	}
	// The same with a row that can be read: the answer is this attempt's, and PersistAnswer
	// says so.
	c2 := c
	c2.Key = "lost-reply-read"
	d2, err := dbidem.Begin(ctx, pool, c2)
	if err != nil || d2.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d2, err)
	}
	pctx2, cancel2 := context.WithTimeout(ctx, 10*time.Second)
	defer cancel2()
	if err := dbidem.PersistAnswer(pctx2, &loseFirstReply{pool: pool}, pool, c2, d2.Attempt, dbidem.Response{Status: 201}); err != nil {
		t.Errorf("PersistAnswer after a lost reply, with the row readable: %v; want nil (the answer landed)", err)
	}
}

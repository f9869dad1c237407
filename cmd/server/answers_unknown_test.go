package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLedgerAnswersWhatItCannotKnow: a fault review cut the connection after a stepped payout's
// reserve step had sent its COMMIT (idem.Step: ErrCommitUnknown), and after a payout's lease had
// run out while the provider was called (the handler's context ended with idem.ErrLeaseLost):
// both were answered 500 "nothing was changed", with the money held or paid. A step whose
// COMMIT's outcome is unknown is answered 503 outcome_unknown, as the middleware answers its own;
// a provider call that failed says it may have been made; a lease lost meanwhile is answered by
// the middleware (the handler writes nothing); a payout whose recording was cut off is not said
// unrecorded.
func TestLedgerAnswersWhatItCannotKnow(t *testing.T) {
	t.Parallel()
	s := &ledger{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	keyed := func(ctx context.Context) *http.Request {
		r := httptest.NewRequestWithContext(ctx, "POST", "/v1/payouts/stepped", nil)
		r.Header.Set("Idempotency-Key", "k")
		return r
	}
	unknown := fmt.Errorf("%w: conn closed", idem.ErrCommitUnknown)
	for _, c := range []struct {
		name   string
		answer func(http.ResponseWriter, *http.Request, error)
	}{{"serverError", s.serverError}, {"stepError", s.stepError}, {"unrecordedPayout", s.unrecordedPayout}, {"providerFailed", s.providerFailed}} {
		w := httptest.NewRecorder()
		c.answer(w, keyed(context.Background()), unknown)
		if w.Code != http.StatusServiceUnavailable || !strings.Contains(w.Body.String(), idem.CodeOutcomeUnknown) ||
			w.Header().Get("Retry-After") != "1" || strings.Contains(w.Body.String(), "nothing was changed") {
			t.Errorf("%s of a COMMIT whose outcome is unknown: %d %s; want 503 outcome_unknown with Retry-After", c.name, w.Code, w.Body)
		}
	}

	// pgx's statement cache through a pooler is the database's failure in every helper (a
	// stepped payout's answered 500 "stopped after some of its steps" for it).
	cache := &pgconn.PgError{Code: "26000", Message: `prepared statement "stmtcache_1" does not exist`}
	for _, c := range []struct {
		name   string
		answer func(http.ResponseWriter, *http.Request, error)
	}{{"serverError", s.serverError}, {"stepError", s.stepError}, {"unrecordedPayout", s.unrecordedPayout}, {"providerFailed", s.providerFailed}} {
		w := httptest.NewRecorder()
		c.answer(w, keyed(context.Background()), cache)
		if w.Code != http.StatusServiceUnavailable || !strings.Contains(w.Body.String(), "service_unavailable") {
			t.Errorf("%s of pgx's statement cache through a pooler: %d %s; want 503 service_unavailable", c.name, w.Code, w.Body)
		}
	}

	failed := errors.New("provider: read tcp: connection reset by peer")
	w := httptest.NewRecorder()
	s.providerFailed(w, keyed(context.Background()), failed)
	if w.Code != http.StatusInternalServerError || strings.Contains(w.Body.String(), "nothing was changed") ||
		!strings.Contains(w.Body.String(), "may have been made") {
		t.Errorf("a provider call that failed: %d %s; want 500 saying the call may have been made", w.Code, w.Body)
	}

	lost, cancel := context.WithCancelCause(context.Background())
	cancel(idem.ErrLeaseLost)
	w = httptest.NewRecorder()
	s.providerFailed(w, keyed(lost), context.Cause(lost))
	if w.Body.Len() != 0 || len(w.Header()) != 0 || w.Code != http.StatusOK {
		t.Errorf("a provider call cut by a lost lease: %d %v %s; want nothing written (the middleware answers)", w.Code, w.Header(), w.Body)
	}

	w = httptest.NewRecorder()
	s.unrecordedPayout(w, keyed(context.Background()), errors.New("unexpected EOF"))
	if w.Code != http.StatusInternalServerError || strings.Contains(w.Body.String(), "could not be recorded") {
		t.Errorf("a payout whose recording was cut off: %d %s; want 500 that does not call it unrecorded", w.Code, w.Body)
	}
}

// TestPayoutWhoseLeaseRanOutIsNotNothingChanged: a payout's lease runs out while the provider is
// called (its extensions wait on the key's row, locked from outside until just past the
// lease's end): the claim was given up and the handler's answer sent, 500 "nothing was
// changed", with the provider's payout made. The handler now writes nothing, and the
// middleware answers 409 request_in_progress; the retry pays under the same provider key, once.
func TestPayoutWhoseLeaseRanOutIsNotNothingChanged(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUTS_LEASE": "1500ms", "PAYOUT_PROVIDER_DELAY": "4s"})
	_, token := s.principal("lost")
	account := int(s.call("POST", "/v1/accounts", token, "acc", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", account), token, "dep", `{"amount":100}`); r.status != 201 {
		t.Fatalf("deposit: %d %s", r.status, r.body)
	}
	direct := pgtest.Connect(t, s.db)
	ctx := context.Background()
	answered := make(chan resp, 1)
	body := fmt.Sprintf(`{"account":%d,"amount":7}`, account)
	go func() { answered <- s.call("POST", "/v1/payouts", token, "po-lost", body) }()
	// The claim is committed (a lease route claims on its own); lock its row, so that every
	// extension waits, and the lease runs out by the server's clock.
	pgtest.WaitFor(t, direct, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'po-lost' AND state = 'p'`)
	lock, err := direct.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, lock, `SELECT 1 FROM idem.idempotency_keys WHERE key = 'po-lost' FOR UPDATE`)
	// The lease's end by the database's clock (never earlier than the server's); a little past
	// it the lock goes, so that the middleware's giving the claim up (idem_yield, which also
	// waits for the row) succeeds and the handler's own answer is what the client gets.
	var end time.Time
	if err := direct.QueryRow(ctx, `SELECT lease_expires_at FROM idem.idempotency_keys WHERE key = 'po-lost'`).Scan(&end); err != nil {
		t.Fatal(err)
	}
	var now time.Time
	if err := direct.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	time.Sleep(end.Sub(now) + 300*time.Millisecond)
	_ = lock.Rollback(ctx)
	var r resp
	select {
	case r = <-answered:
	case <-time.After(30 * time.Second):
		t.Fatal("no answer within 30 s")
	}
	if r.status != http.StatusConflict || !strings.Contains(string(r.body), "request_in_progress") || strings.Contains(string(r.body), "nothing was changed") {
		t.Fatalf("a payout whose lease ran out while the provider was called: %d %s; want 409 request_in_progress", r.status, r.body)
	}
	var final resp
	for range 40 {
		if final = s.call("POST", "/v1/payouts", token, "po-lost", body); final.status == 201 {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	if final.status != 201 {
		t.Fatalf("the retry: %d %s, want 201", final.status, final.body)
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM provider.payouts`); n != 1 {
		t.Errorf("%d provider payouts, want 1", n)
	}
}

package idemhttp_test

// A review of D161 (a claim's probe runs to its end when the wait has ended) at the
// HTTP level: checked, correct.

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// slowClaim makes the claim INSERT of key sleep a second (a trigger, as
// TestShutdownServesFreshKeysWhileItWaits does), so that a probe is held open.
func slowClaim(t *testing.T, a *app, key string) {
	t.Helper()
	pgtest.Exec(t, a.pool, `CREATE OR REPLACE FUNCTION public.slow_claim() RETURNS trigger LANGUAGE plpgsql AS
		$$BEGIN PERFORM pg_sleep(1); RETURN NEW; END$$`)
	pgtest.Exec(t, a.pool, `CREATE TRIGGER slow_claim_`+key+` BEFORE INSERT ON idem.idempotency_keys
		FOR EACH ROW WHEN (NEW.key = '`+key+`') EXECUTE FUNCTION public.slow_claim()`)
}

// TestProbeReviewClientGoneDuringProbeRunsOnceAndReplays (checked, correct): since D161 a client that
// leaves while its request's probe runs no longer cancels it: the claim stands and the work
// runs for nobody. That must stay one effect: the retry with the same key replays (on a
// transactional route and on a lease route), and the work ran once.
func TestProbeReviewClientGoneDuringProbeRunsOnceAndReplays(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	for _, c := range []struct {
		path, key, body string
		status          int
	}{
		{"/transfers", "gonetx", `{"amount":4}`, 201},
		{"/jobs", "gonelease", `{}`, 202},
	} {
		slowClaim(t, a, c.key)
		runs := a.runs.Load()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan reply, 1)
		go func() { done <- a.doCtx(ctx, "POST", c.path, "alice", c.key, c.body) }()
		pgtest.WaitFor(t, a.pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'`)
		cancel() // the client leaves while the probe's INSERT sleeps
		<-done
		deadline := time.Now().Add(10 * time.Second)
		for a.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = $1 AND state = 'c'`, c.key) == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the work of a client gone during its probe never completed (%d runs)", c.path, a.runs.Load()-runs)
			}
			time.Sleep(20 * time.Millisecond)
		}
		r := a.do("POST", c.path, "alice", c.key, c.body)
		if r.status != c.status || r.header.Get("Idempotent-Replayed") != "true" || a.runs.Load()-runs != 1 {
			t.Errorf("%s: the retry after the client left during its probe: %d %s (replayed %q), %d runs; want the replay of one run",
				c.path, r.status, r.body, r.header.Get("Idempotent-Replayed"), a.runs.Load()-runs)
		}
	}
	if n := a.count(`SELECT count(*) FROM effects WHERE amount = 4`); n != 1 {
		t.Errorf("%d effects, want 1", n)
	}
}

// TestProbeReviewProbePastShutdownDeadlineClaimsNothing (checked, correct): the probe runs under the
// work's context, which Shutdown's deadline ends: a probe held open (its INSERT sleeps) when
// the deadline passes does not claim, nothing runs, nothing is stored, and the client is told
// to retry (not 409 for a key nobody holds, not a stored answer).
func TestProbeReviewProbePastShutdownDeadlineClaimsNothing(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	slowClaim(t, a, "late")
	done := make(chan reply, 1)
	go func() { done <- a.do("POST", "/transfers", "alice", "late", `{"amount":9}`) }()
	pgtest.WaitFor(t, a.pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'`)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err := a.m.Shutdown(ctx)
	r := <-done
	t.Logf("Shutdown: %v; the request: %d %s", err, r.status, r.body)
	time.Sleep(1500 * time.Millisecond) // the sleeping INSERT's second is over
	if k, e := a.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'late'`), a.count(`SELECT count(*) FROM effects WHERE amount = 9`); k != 0 || e != 0 {
		t.Errorf("after Shutdown's deadline ended a probe under way: %d keys, %d effects; want none", k, e)
	}
	if r.status < 500 || strings.Contains(r.body, "request_in_progress") {
		t.Errorf("the request whose probe Shutdown's deadline ended: %d %s; want a 5xx to retry", r.status, r.body)
	}
	if r2 := a.do("POST", "/transfers", "alice", "late", `{"amount":9}`); r2.status != http.StatusServiceUnavailable || problemCode(t, r2) != idemhttp.CodeShuttingDown {
		t.Errorf("a keyed request after Shutdown's deadline: %d %s, want 503 %s", r2.status, r2.body, idemhttp.CodeShuttingDown)
	}
}

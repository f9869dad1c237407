package idem_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLeaseDuplicatesAreNotCoalesced: idempotency_coalesced_total counts a transactional route's
// duplicates, "not a duplicate on a lease route, which waits on the lease's answer". Duplicates
// that came while the first request was still claiming waited in the Gate's line behind that
// claim and were counted, so the figure depended on the timing (D246). The first claim is
// held open here by a trigger that sleeps in its INSERT while three duplicates wait in line.
func TestLeaseDuplicatesAreNotCoalesced(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	pgtest.Exec(t, pool, `CREATE FUNCTION public.slow_claim() RETURNS trigger LANGUAGE plpgsql AS
		$$BEGIN IF NEW.key = 'slow-lease' THEN PERFORM pg_sleep(1.5); END IF; RETURN NEW; END$$`)
	pgtest.Exec(t, pool, `CREATE TRIGGER slow_claim BEFORE INSERT ON idem.idempotency_keys
		FOR EACH ROW EXECUTE FUNCTION public.slow_claim()`)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/x", m.Route(idem.Route{Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"done":true}`)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	var wg sync.WaitGroup
	res := make([]d233Resp, 4)
	post := func(i int) {
		defer wg.Done()
		res[i] = d233Post(t, srv.URL+"/v1/x", "slow-lease", `{"a":1}`)
	}
	wg.Add(1)
	go post(0)
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE '%idem_begin%' AND wait_event = 'PgSleep'`)
	for i := 1; i < 4; i++ {
		wg.Add(1)
		go post(i)
	}
	deadline := time.Now().Add(5 * time.Second)
	for m.GateStats().Waiting != 3 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	waiting := m.GateStats().Waiting
	wg.Wait()
	if waiting != 3 {
		t.Fatalf("the duplicates did not wait in the Gate's line behind the first claim (Waiting %d): the test did not hold the gap open", waiting)
	}
	for i, r := range res {
		if r.code != http.StatusCreated || r.body != `{"done":true}` {
			t.Errorf("request %d: %d %s; want the first answer", i, r.code, r.body)
		}
	}
	if st := m.GateStats(); st.Coalesced != 0 || st.Refused != 0 {
		t.Errorf("GateStats %+v after three duplicates of a lease route; want Coalesced 0 (a lease route's duplicates are not counted) and Refused 0", st)
	}
}

// TestLeaseDuplicateWhoseWaitRanOutIsRefused: idempotency_refused_total counts "requests
// answered 409 without waiting on the database (their wait ran out ...)". A lease route's
// duplicate waits for the lease's answer without a connection; told 409 when that wait ran out,
// it was not counted, where a transactional duplicate is (D246).
func TestLeaseDuplicateWhoseWaitRanOutIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice, DuplicateWait: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}, 1), make(chan struct{})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/x", m.Route(idem.Route{Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-release
		w.WriteHeader(http.StatusCreated)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	done := make(chan d233Resp, 1)
	go func() { done <- d233Post(t, srv.URL+"/v1/x", "held", `{"a":1}`) }()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		close(release)
		t.Fatal("the first request never ran its handler")
	}
	var dups [2]d233Resp
	var wg sync.WaitGroup
	for i := range dups {
		wg.Add(1)
		go func() { defer wg.Done(); dups[i] = d233Post(t, srv.URL+"/v1/x", "held", `{"a":1}`) }()
	}
	wg.Wait()
	close(release)
	if first := <-done; first.code != http.StatusCreated {
		t.Fatalf("the first request: %d %s", first.code, first.body)
	}
	for i, d := range dups {
		if d.code != http.StatusConflict {
			t.Fatalf("duplicate %d while the first ran: %d %s; want 409 once its 300 ms wait ran out", i, d.code, d.body)
		}
	}
	if st := m.GateStats(); st.Refused != 2 || st.Coalesced != 0 {
		t.Errorf("GateStats %+v after two duplicates of a lease route told 409 when their wait ran out; want Refused 2, Coalesced 0", st)
	}
}

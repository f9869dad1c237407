package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// receiver is a simulated webhook receiver of receipts: like a real one it deduplicates by
// the Idempotency-Key header (the first call with a key has an effect, a later one is a
// repeat that answers the same), and it counts both. With hold set, the first call waits
// until its sender goes away (or the test ends) before it answers: a send that a worker
// killed in the middle never sees answered.
type receiver struct {
	url     string
	mu      sync.Mutex
	calls   map[string]int         // per key, every call
	effects map[string]receiptArgs // per key, the receipt of the call that had the effect
	arrived chan struct{}          // closed at the first call
	once    sync.Once
}

func newReceiver(t *testing.T, hold bool) *receiver {
	t.Helper()
	rcv := &receiver{calls: map[string]int{}, effects: map[string]receiptArgs{}, arrived: make(chan struct{})}
	done := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		var in receiptArgs
		body, _ := io.ReadAll(r.Body)
		if key == "" || json.Unmarshal(body, &in) != nil {
			http.Error(w, "want a JSON receipt and an Idempotency-Key", http.StatusBadRequest)
			return
		}
		rcv.mu.Lock()
		rcv.calls[key]++
		first := len(rcv.calls) == 1 && rcv.calls[key] == 1
		if _, seen := rcv.effects[key]; !seen {
			rcv.effects[key] = in
		}
		rcv.mu.Unlock()
		rcv.once.Do(func() { close(rcv.arrived) })
		if hold && first {
			select {
			case <-r.Context().Done(): // the sender went away
			case <-done:
			}
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(func() { close(done); srv.Close() })
	rcv.url = srv.URL + "/receipts"
	return rcv
}

// figures are the receiver's counts: the keys with an effect, and the calls per key.
func (rcv *receiver) figures() (map[string]receiptArgs, map[string]int) {
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	effects, calls := map[string]receiptArgs{}, map[string]int{}
	for k, v := range rcv.effects {
		effects[k] = v
	}
	for k, v := range rcv.calls {
		calls[k] = v
	}
	return effects, calls
}

// waitForCount polls a count until it is above zero, for up to d.
func waitForCount(t *testing.T, s *testServer, d time.Duration, sql string, args ...any) {
	t.Helper()
	for deadline := time.Now().Add(d); s.count(sql, args...) == 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			var errs string
			_ = s.pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(state::text || ' ' || errors::text, '; '), '') FROM river.river_job`).Scan(&errs)
			t.Fatalf("never true within %s: %s %v (jobs: %s)", d, sql, args, errs)
		}
	}
}

// seedAccounts makes two EUR accounts of the token's principal, the first with 10000.
func seedAccounts(t *testing.T, s *testServer, token string) (from, to int) {
	t.Helper()
	id := func() int {
		return int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	}
	from, to = id(), id()
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", from), token, "", `{"amount":10000}`); r.status != 201 {
		t.Fatalf("seed: %+v", r)
	}
	return from, to
}

// TestReceiptEnqueuedOnceForARetriedTransfer: a transfer enqueues the River job of its
// receipt in its own transaction: the transfer's retries (replays) enqueue nothing more, a
// transfer refused with a final error (422, rolled back) enqueues nothing, and the job
// delivers the receipt of the transfer once, under the Idempotency-Key of its claim.
func TestReceiptEnqueuedOnceForARetriedTransfer(t *testing.T) {
	t.Parallel()
	rcv := newReceiver(t, false)
	s := startServer(t, map[string]string{"RECEIPT_URL": rcv.url})
	_, token := s.principal("alice")
	from, to := seedAccounts(t, s, token)
	body := fmt.Sprintf(`{"from":%d,"to":%d,"amount":2500}`, from, to)
	first := s.call("POST", "/v1/transfers", token, "t-1", body)
	if first.status != 201 {
		t.Fatalf("the transfer: %+v", first)
	}
	transfer := int64(first.json(t)["id"].(float64))
	for range 2 {
		if r := s.call("POST", "/v1/transfers", token, "t-1", body); r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" || r.body != first.body {
			t.Fatalf("the retry: %+v", r)
		}
	}
	if r := s.call("POST", "/v1/transfers", token, "t-2", fmt.Sprintf(`{"from":%d,"to":%d,"amount":999999}`, from, to)); r.status != 422 {
		t.Fatalf("a transfer over the balance: %+v", r)
	}
	if n := s.count(`SELECT count(*) FROM river.river_job WHERE kind = 'receipt'`); n != 1 {
		t.Fatalf("%d receipt jobs after a transfer, two retries and a refused transfer; want 1", n)
	}
	waitForCount(t, s, 30*time.Second, `SELECT count(*) FROM river.river_job WHERE kind = 'receipt' AND state = 'completed'`)
	effects, calls := rcv.figures()
	if len(effects) != 1 || len(calls) != 1 {
		t.Fatalf("the receiver: effects %v, calls %v; want one receipt under one key", effects, calls)
	}
	for key, r := range effects {
		if r.Transfer != transfer || r.Amount != 2500 || r.From != int64(from) || calls[key] != 1 {
			t.Fatalf("the receipt %+v (%d calls), want transfer %d's", r, calls[key], transfer)
		}
	}
}

// TestReceiptSurvivesAWorkerKill: the server (a child process) is killed with SIGKILL while
// its River worker sends a receipt (the receiver has taken the call and not answered); the
// job stays running, its key in progress. A new server's River rescues the job (past
// RECEIPT_RESCUE_AFTER) and retries it; the retry takes the key over once the dead worker's
// lease ran out and sends again under the same Idempotency-Key: the receiver sees two calls
// and acts once, and the job completes.
func TestReceiptSurvivesAWorkerKill(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil) // migrates the database; its own server has no receipts
	_, token := s.principal("alice")
	from, to := seedAccounts(t, s, token)
	rcv := newReceiver(t, true)
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	p := &process{t: t, bin: serverBinary(t), addr: addr, env: append(os.Environ(),
		"DATABASE_URL="+s.db, "LISTEN_ADDR="+addr, "CLEANUP_INTERVAL=0", "LOG_LEVEL=error",
		"RECEIPT_URL="+rcv.url, "RECEIPT_LEASE=1s", "RECEIPT_TIMEOUT=3s", "RECEIPT_RESCUE_AFTER=4s")}
	p.start()
	defer p.kill()
	status, _, body := pgtest.Send(t, context.Background(), "POST", "http://"+addr+"/v1/transfers",
		fmt.Sprintf(`{"from":%d,"to":%d,"amount":700}`, from, to),
		"Authorization", "Bearer "+token, "Idempotency-Key", "t-kill", "Content-Type", "application/json")
	if status != 201 {
		t.Fatalf("the transfer: %d %s", status, body)
	}
	select {
	case <-rcv.arrived:
	case <-time.After(30 * time.Second):
		t.Fatal("the receipt was never sent")
	}
	p.kill()
	if n := s.count(`SELECT count(*) FROM river.river_job WHERE kind = 'receipt' AND state = 'running' AND attempt = 1`); n != 1 {
		t.Fatal("the killed worker's job is not running")
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'receipt/%' AND state = 'p'`); n != 1 {
		t.Fatal("the killed worker's key is not in progress")
	}

	p.start()
	waitForCount(t, s, 2*time.Minute, `SELECT count(*) FROM river.river_job WHERE kind = 'receipt' AND state = 'completed'`)
	effects, calls := rcv.figures()
	if len(effects) != 1 || len(calls) != 1 {
		t.Fatalf("the receiver: effects %v, calls %v; want one receipt under one key", effects, calls)
	}
	for key, r := range effects {
		if calls[key] != 2 || r.Amount != 700 {
			t.Fatalf("the receiver: %d calls under %q (%+v), want the killed send's and the retry's", calls[key], key, r)
		}
	}
	if n := s.count(`SELECT count(*) FROM river.river_job WHERE kind = 'receipt'`); n != 1 {
		t.Fatalf("%d receipt jobs, want 1", n)
	}
	if n := s.count(`SELECT attempt FROM river.river_job WHERE kind = 'receipt'`); n != 2 {
		t.Fatalf("the job completed at attempt %d, want 2 (the killed one and River's retry)", n)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'receipt/%' AND state = 'c'`); n != 1 {
		t.Fatal("the job's key is not completed")
	}
}

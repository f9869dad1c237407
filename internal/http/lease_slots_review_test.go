package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLockedLeaseRowAndItsRetryDoNotCostAnotherLease (review finding, D229): docs/operations.md
// says one locked lease row does not cost other leases theirs. The same scenario as
// TestLeaseKeepsItsLeaseWhileAnotherKeysRowIsLocked (pool of 4, default MaxWaitingClaims, lease
// A's row held FOR UPDATE by another session), plus what a locked lease row brings with it: A's
// client retries A, and the duplicate's claim waits on A's row in the Gate's one wait slot, on
// a pool connection. With the first build of D229 that connection and A's statement in the
// lease slot made half the pool "in use", so nothing ran beside the slot, and the unrelated
// lease B, its row free and a connection idle, lost its lease (409 after 2.07 s).
func TestLockedLeaseRowAndItsRetryDoNotCostAnotherLease(t *testing.T) {
	t.Parallel()
	srv, url, started := leaseSlotApp(t)
	ctx := context.Background()
	dupReply, bReply := make(chan int, 1), make(chan int, 1)
	aReply, locker := leaseWithItsRowLocked(t, srv.URL, url, started, "4s")

	// A's client retries A: the duplicate's claim waits on A's locked row.
	go func() {
		status, _, _ := pgtest.Send(t, ctx, "POST", srv.URL+"/jobs?work=4s", `{}`, "Idempotency-Key", "a",
			"Content-Type", "application/json")
		dupReply <- status
	}()
	watcher := pgtest.Connect(t, url)
	pgtest.WaitFor(t, watcher, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND query NOT LIKE '%idem_extend%'`)

	began := time.Now()
	go func() {
		status, _, _ := pgtest.Send(t, ctx, "POST", srv.URL+"/jobs?work=6s", `{}`, "Idempotency-Key", "b",
			"Content-Type", "application/json")
		bReply <- status
	}()
	if k := <-started; k != "b" {
		t.Fatalf("started %q, want b", k)
	}
	b := <-bReply
	took := time.Since(began)
	pgtest.Exec(t, locker, `ROLLBACK`)
	a, dup := <-aReply, <-dupReply
	t.Logf("A (its row locked): %d; A's retry: %d; B: %d after %v", a, dup, b, took.Round(time.Millisecond))
	if b != http.StatusCreated {
		t.Errorf("lease B, its row free, answered %d after %v, want 201: one locked lease row (and its client's retry) "+
			"cost an unrelated lease its lease", b, took.Round(time.Millisecond))
	}
}

// TestLeaseAnswersUnderATableLockStayWithinHalfThePool (review finding, D229): under a locked
// key table lease statements hold at most half the pool. Here the leases are short (1 s, the
// shortest a route may declare), so their answers' deadlines pass while the key table is
// locked (ACCESS EXCLUSIVE, from a session outside the pool). A completion that ends at its
// deadline with its outcome unknown reads the key's row to learn whether it landed
// (dbidem.PersistAnswer's answered); that read went to the pool itself, outside the lease
// slots, and waited on the lock too: 4 of 4 connections waited, and an unkeyed query waited
// 1 s for one. The read takes a lease slot now.
func TestLeaseAnswersUnderATableLockStayWithinHalfThePool(t *testing.T) {
	t.Parallel()
	const poolSize, leases = 4, 8
	pool, url, _, release, replies := workingShortLeases(t, poolSize, leases, "short")
	ctx := context.Background()
	locker := pgtest.Connect(t, url)
	watcher := pgtest.Connect(t, url)
	var lockerPID, watcherPID int
	if err := locker.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&lockerPID); err != nil {
		t.Fatal(err)
	}
	if err := watcher.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&watcherPID); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, locker, `BEGIN`)
	pgtest.Exec(t, locker, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	defer func() { _, _ = locker.Exec(context.WithoutCancel(ctx), `ROLLBACK`) }()
	close(release)

	// Sampled for 3 s: the pool's backends waiting on the lock, and an unkeyed query's wait.
	var mu sync.Mutex
	maxWaiting, worstQuery := 0, time.Duration(0)
	var atMax []string
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			began := time.Now()
			qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			var one int
			_ = pool.QueryRow(qctx, `SELECT 1`).Scan(&one)
			cancel()
			mu.Lock()
			worstQuery = max(worstQuery, time.Since(began))
			mu.Unlock()
		}
	}()
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		rows, err := watcher.Query(ctx, `SELECT left(regexp_replace(query, '\s+', ' ', 'g'), 60) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid NOT IN ($1, $2)`, lockerPID, watcherPID)
		if err != nil {
			t.Fatal(err)
		}
		var qs []string
		for rows.Next() {
			var q string
			if err := rows.Scan(&q); err != nil {
				t.Fatal(err)
			}
			qs = append(qs, q)
		}
		rows.Close()
		if len(qs) > maxWaiting {
			maxWaiting, atMax = len(qs), qs
		}
	}
	close(stop)
	wg.Wait()
	pgtest.Exec(t, locker, `ROLLBACK`)
	statuses := make([]int, 0, leases)
	for range leases {
		statuses = append(statuses, <-replies)
	}
	t.Logf("at most %d of the pool's %d connections waited on the locked table at once (%q); the slowest unkeyed query took %v; replies %v",
		maxWaiting, poolSize, atMax, worstQuery.Round(time.Millisecond), statuses)
	if maxWaiting > poolSize/2 {
		t.Errorf("%d of the pool's %d connections waited on the locked key table at once, want at most half (%d): %q",
			maxWaiting, poolSize, poolSize/2, atMax)
	}
	if worstQuery > 500*time.Millisecond {
		t.Errorf("an unkeyed query on the pool waited %v for a connection while the key table was locked",
			worstQuery.Round(time.Millisecond))
	}
}

// slotWaiters counts the goroutines waiting for a lease slot, and those among them that are
// an answer's recording sent on a context that never ends (dbidem's sendCommitting).
func slotWaiters() (all, committing int) {
	buf := make([]byte, 1<<24)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "leaseSlots.take") || strings.Contains(g, "leaseSlots).take") {
			all++
			if strings.Contains(g, "sendCommitting") {
				committing++
			}
		}
	}
	return all, committing
}

// TestAnswerStopsWaitingForASlotAtItsDeadline (review finding, D229): a statement that finds no
// lease slot waits in Go as long as its context lets it. The recording of a lease's answer is
// sent through dbidem.Complete from a goroutine on a context that never ends (D165), and it
// took its slot there, so its wait never ended: under a locked key table, after every lease
// request was answered (503 outcome_unknown) and Middleware.Shutdown returned, recordings were
// still queued for the slots, statements to be sent whenever a slot came. The slot is taken on
// the caller's context now (dbidem.Bounded).
func TestAnswerStopsWaitingForASlotAtItsDeadline(t *testing.T) {
	// Not parallel: the goroutines counted must be this test's alone.
	const poolSize, leases = 4, 8
	_, url, m, release, replies := workingShortLeases(t, poolSize, leases, "late")
	ctx := context.Background()
	locker := pgtest.Connect(t, url)
	pgtest.Exec(t, locker, `BEGIN`)
	pgtest.Exec(t, locker, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	defer func() { _, _ = locker.Exec(context.WithoutCancel(ctx), `ROLLBACK`) }()
	close(release)
	statuses := make([]int, 0, leases)
	for range leases {
		statuses = append(statuses, <-replies)
	}
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	serr := m.Shutdown(sctx)
	cancel()
	time.Sleep(3 * time.Second) // well past every answer's deadline (one lease, 1 s)
	all, committing := slotWaiters()
	pgtest.Exec(t, locker, `ROLLBACK`)
	t.Logf("replies %v; Shutdown: %v; 3 s later, still under the lock: %d goroutines wait for a lease slot, %d of them answers' recordings",
		statuses, serr, all, committing)
	if all > 0 {
		t.Errorf("%d goroutines (%d of them answers' recordings on a context that never ends) still wait for a lease slot "+
			"after every lease request was answered and Shutdown returned: the slot wait does not end with the statement's context",
			all, committing)
	}
}

// TestExtensionsUnderATableLockStayWithinHalfThePool (review, held when written):
// many leases at once on pools of 2 to 16 (default MaxWaitingClaims), the key table locked for
// 2.5 s from outside the pool, shorter than the leases: the pool's backends waiting on the
// lock (the leases' extensions) never pass half the pool, an unkeyed query gets a connection
// at once, and every lease keeps its lease.
func TestExtensionsUnderATableLockStayWithinHalfThePool(t *testing.T) {
	t.Parallel()
	for _, poolSize := range []int{2, 3, 5, 8, 16} {
		t.Run(fmt.Sprint(poolSize), func(t *testing.T) {
			t.Parallel()
			leases := 3 * poolSize
			pool, url := pgtest.NewPool(t, int32(poolSize))
			ctx := context.Background()
			m, err := idemhttp.New(idemhttp.Options{DB: pool,
				Principal: func(r *http.Request) (string, bool) { return "alice", true },
				Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)), RouteTemplate: muxTemplate})
			if err != nil {
				t.Fatal(err)
			}
			started, release := make(chan struct{}, leases), make(chan struct{})
			r := mux.NewRouter()
			r.Handle("/jobs", m.Route(idemhttp.Route{Lease: 6 * time.Second, Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				started <- struct{}{}
				<-release
				w.WriteHeader(http.StatusCreated)
			}))).Methods("POST")
			srv := httptest.NewServer(r)
			defer srv.Close()
			replies := make(chan int, leases)
			for i := range leases {
				go func() {
					status, _, _ := pgtest.Send(t, ctx, "POST", srv.URL+"/jobs", `{}`, "Idempotency-Key", fmt.Sprintf("ext-%d", i),
						"Content-Type", "application/json")
					replies <- status
				}()
			}
			for range leases {
				<-started
			}
			locker := pgtest.Connect(t, url)
			watcher := pgtest.Connect(t, url)
			pgtest.Exec(t, locker, `BEGIN`)
			pgtest.Exec(t, locker, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
			defer func() { _, _ = locker.Exec(context.WithoutCancel(ctx), `ROLLBACK`) }()
			maxWaiting, worst := 0, time.Duration(0)
			for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
				n := pgtest.Count(t, watcher, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
					AND wait_event_type = 'Lock' AND query LIKE '%idem_%' AND query NOT LIKE '%LOCK TABLE%'`)
				maxWaiting = max(maxWaiting, n)
				began := time.Now()
				var one int
				if err := pool.QueryRow(ctx, `SELECT 1`).Scan(&one); err != nil {
					t.Fatal(err)
				}
				worst = max(worst, time.Since(began))
			}
			pgtest.Exec(t, locker, `ROLLBACK`)
			close(release)
			lost := 0
			for range leases {
				if <-replies != http.StatusCreated {
					lost++
				}
			}
			t.Logf("pool %d, %d leases: at most %d waited on the lock; slowest unkeyed query %v; %d lost", poolSize, leases,
				maxWaiting, worst.Round(time.Millisecond), lost)
			if bound := max(poolSize/2, max(1, poolSize/4)); maxWaiting > bound {
				t.Errorf("pool %d: %d lease statements waited on the locked table at once, want at most %d", poolSize, maxWaiting, bound)
			}
			if worst > 500*time.Millisecond {
				t.Errorf("pool %d: an unkeyed query waited %v", poolSize, worst.Round(time.Millisecond))
			}
			if lost > 0 {
				t.Errorf("pool %d: %d of %d leases lost through a lock shorter than their lease", poolSize, lost, leases)
			}
		})
	}
}

// workingShortLeases starts leases requests on a lease route of 1 s (the shortest a route may
// declare) on a pool of poolSize, keys prefix-0, prefix-1 ..., and returns once every handler
// runs; each answers 201 once release is closed, and replies gets each request's status.
func workingShortLeases(t *testing.T, poolSize int32, leases int, prefix string) (pool *pgxpool.Pool, url string,
	m *idemhttp.Middleware, release chan struct{}, replies chan int) {
	t.Helper()
	pool, url = pgtest.NewPool(t, poolSize)
	m, err := idemhttp.New(idemhttp.Options{DB: pool,
		Principal: func(r *http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)), RouteTemplate: muxTemplate})
	if err != nil {
		t.Fatal(err)
	}
	started, release := make(chan struct{}, leases), make(chan struct{})
	r := mux.NewRouter()
	r.Handle("/jobs", m.Route(idemhttp.Route{Lease: time.Second, Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-release
		w.WriteHeader(http.StatusCreated)
	}))).Methods("POST")
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	replies = make(chan int, leases)
	for i := range leases {
		go func() {
			status, _, _ := pgtest.Send(t, context.Background(), "POST", srv.URL+"/jobs", `{}`, "Idempotency-Key",
				fmt.Sprintf("%s-%d", prefix, i), "Content-Type", "application/json")
			replies <- status
		}()
	}
	for range leases {
		<-started
	}
	return pool, url, m, release, replies
}

package idem_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCommitWaitingForTheStandbyIsNeverCanceled: a COMMIT that waits for a synchronous
// standby when its caller's context ends. A cancel request would end the wait with a warning
// and leave the transaction committed on the primary alone, visible there: the caller, or the
// next replay, would be told "done" for a key that a failover then loses (docs/DECISIONS.md,
// D108). Do must close the connection instead: it returns ErrCommitUnknown at the deadline,
// the backend keeps waiting with the key and the effect invisible, and once the standby
// answers (here: synchronous_standby_names is cleared, which releases the waiters as a
// standby's reply would) the effect is there once and a retry replays it.
//
// A cluster of its own: synchronous_standby_names is a server-wide setting, and every commit
// of the shared test cluster would wait for the standby that never comes.
func TestCommitWaitingForTheStandbyIsNeverCanceled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, stop, err := pgcluster.StartTemp(ctx, "idem-syncrep-", map[string]string{"fsync": "off"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	url := c.ConnString("postgres")
	owner, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Close(ctx)
	if err := idemmigrate.Migrate(ctx, owner, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, owner, `CREATE TABLE effects (id bigint GENERATED ALWAYS AS IDENTITY, note text)`)
	// Every commit from here on waits for a standby named ghost, which never connects.
	pgtest.Exec(t, owner, `ALTER SYSTEM SET synchronous_standby_names = 'ghost'`)
	pgtest.Exec(t, owner, `SELECT pg_reload_conf()`)

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	for deadline := time.Now().Add(10 * time.Second); ; {
		var names string
		if err := pool.QueryRow(ctx, `SHOW synchronous_standby_names`).Scan(&names); err != nil {
			t.Fatal(err)
		}
		if names == "ghost" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("synchronous_standby_names is %q after the reload, want ghost", names)
		}
		time.Sleep(20 * time.Millisecond)
	}

	job := idem.Job{Principal: "syncrep", Key: "k1", Action: "POST /effects", Input: map[string]int{"n": 1}}
	runs := 0
	work := func(ctx context.Context, tx pgx.Tx) (int64, error) {
		runs++
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO effects (note) VALUES ('once') RETURNING id`).Scan(&id)
		return id, err
	}
	dctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	started := time.Now()
	_, _, err = idem.Do(dctx, pool, job, idem.TxOptions{}, work)
	cancel()
	took := time.Since(started)
	if !errors.Is(err, idem.ErrCommitUnknown) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Do whose context ended while its COMMIT waited for the standby: %v, want ErrCommitUnknown and the deadline", err)
	}
	if took > 5*time.Second {
		t.Fatalf("Do returned %v after its 500 ms deadline, want at the deadline", took)
	}
	if runs != 1 {
		t.Fatalf("the work ran %d times, want 1", runs)
	}

	// The backend still waits for the standby, and what it committed is invisible: a cancel
	// request would have made both visible here at once.
	pgtest.WaitFor(t, owner, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`)
	time.Sleep(300 * time.Millisecond) // room for a cancel request, were one sent
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`); n != 1 {
		log, _ := os.ReadFile(c.LogFile())
		t.Fatalf("%d backends wait for the synchronous standby, want the one of the COMMIT; server log:\n%s", n, log)
	}
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("%d effects visible while their COMMIT waits for the standby, want 0", n)
	}
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Fatalf("%d keys visible while their COMMIT waits for the standby, want 0", n)
	}

	// The standby "answers": the commit completes, and the retry replays it.
	pgtest.Exec(t, owner, `ALTER SYSTEM RESET synchronous_standby_names`)
	pgtest.Exec(t, owner, `SELECT pg_reload_conf()`)
	pgtest.WaitFor(t, owner, `SELECT (count(*) = 0)::int FROM pg_stat_activity WHERE wait_event = 'SyncRep'`)
	var id int64
	pgtest.WaitFor(t, owner, `SELECT (count(*) = 1)::int FROM effects`)
	if err := owner.QueryRow(ctx, `SELECT id FROM effects`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		got, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, work)
		if err == nil {
			if !replayed || got != id || runs != 1 {
				t.Fatalf("the retry: %d replayed=%v after %d runs, want the replay of %d and one run", got, replayed, runs, id)
			}
			break
		}
		if !errors.Is(err, idem.ErrInProgress) || time.Now().After(deadline) {
			t.Fatalf("the retry after the standby answered: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestClearingSynchronousStandbyNamesAsDocumented: docs/operations.md tells an operator whose
// two-node failover left the new primary waiting for a standby (synchronous_standby_names in
// its postgresql.conf, as the docs configure it) to clear the setting. It said `ALTER SYSTEM
// RESET` and a reload, which only removes a value ALTER SYSTEM set: the one in postgresql.conf
// stayed, and every write kept waiting (a review of the failover runbook). The documented
// `ALTER SYSTEM SET synchronous_standby_names = ”` and a reload release the waiting write.
func TestClearingSynchronousStandbyNamesAsDocumented(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, stop, err := pgcluster.StartTemp(ctx, "idem-syncclear-", map[string]string{"fsync": "off"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	conf, err := os.OpenFile(filepath.Join(c.Dir, "data", "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conf.WriteString("\nsynchronous_standby_names = 'ANY 1 (standby_a, standby_b)'\n"); err != nil {
		t.Fatal(err)
	}
	_ = conf.Close()
	url := c.ConnString("postgres")
	owner, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Close(ctx)
	pgtest.Exec(t, owner, `SELECT pg_reload_conf()`)
	names := func() string {
		var v string
		if err := owner.QueryRow(ctx, `SHOW synchronous_standby_names`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	for deadline := time.Now().Add(10 * time.Second); names() == ""; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("synchronous_standby_names from postgresql.conf never took effect")
		}
	}
	writer, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Close(context.Background())
	// Writes until one waits for a standby: a commit waits only once the checkpointer has
	// taken the reload in too (it publishes whether synchronous standbys are defined), which
	// on a loaded machine comes after the sessions see the setting.
	wrote := make(chan error, 1)
	var waiting atomic.Bool
	go func() {
		for i := 0; ; i++ {
			_, err := writer.Exec(ctx, fmt.Sprintf(`CREATE TABLE after_failover_%d (id int)`, i))
			if err != nil || waiting.Load() {
				wrote <- err
				return
			}
		}
	}()
	pgtest.WaitFor(t, owner, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`)
	waiting.Store(true)

	// What the docs said before: the setting stays, and the write keeps waiting.
	pgtest.Exec(t, owner, `ALTER SYSTEM RESET synchronous_standby_names`)
	pgtest.Exec(t, owner, `SELECT pg_reload_conf()`)
	time.Sleep(500 * time.Millisecond)
	if v := names(); v == "" {
		t.Fatalf("ALTER SYSTEM RESET cleared the setting of postgresql.conf; the docs' warning is wrong")
	}
	select {
	case err := <-wrote:
		t.Fatalf("the write stopped waiting after ALTER SYSTEM RESET (%v); the docs' warning is wrong", err)
	default:
	}

	// What they say now.
	pgtest.Exec(t, owner, `ALTER SYSTEM SET synchronous_standby_names = ''`)
	pgtest.Exec(t, owner, `SELECT pg_reload_conf()`)
	select {
	case err := <-wrote:
		if err != nil {
			t.Fatalf("the waiting write: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the write still waits for a standby 10 s after the documented clearing")
	}
}

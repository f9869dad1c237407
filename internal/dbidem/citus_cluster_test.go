//go:build citus

package dbidem_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCitusErrorForms: on a real Citus cluster (make test-citus, CITUS_URL), the errors that
// reach a client through the coordinator have the forms recorded in citus_test.go, and the
// driver gives each the sentinel it gives on one PostgreSQL: the commit guard's refusal in
// its one-phase form (XX000, a transaction on one worker) and its two-phase form (23503, on
// two workers), an unknown principal (23503 from a worker), a wait on a key past the lock
// timeout, a lost claim; and another table's foreign key failing at a worker's COMMIT is none
// of them.
func TestCitusErrorForms(t *testing.T) {
	db := pgtest.CitusDB(t)
	pgtest.CitusInstall(t, db)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	// The application's principals, referenced from the key table: a reference table, before
	// distribute.sql (docs/scale-out.md, "Your principals table").
	pgtest.Exec(t, pool, `CREATE TABLE public.principals (id text PRIMARY KEY)`)
	pgtest.Exec(t, pool, `SELECT create_reference_table('public.principals')`)
	pgtest.Exec(t, pool, `ALTER TABLE idem.idempotency_keys ADD CONSTRAINT idempotency_keys_principal_fkey
		FOREIGN KEY (principal_id) REFERENCES public.principals (id) ON DELETE CASCADE NOT VALID`)
	pgtest.CitusDistribute(t, db)
	pgtest.Exec(t, pool, `INSERT INTO public.principals SELECT 'p' || i FROM generate_series(0, 99) AS i`)
	// Another table of the application, co-located with the keys, with a deferred foreign key.
	pgtest.Exec(t, pool, `CREATE TABLE public.parents (principal_id text, id int, PRIMARY KEY (principal_id, id));
		CREATE TABLE public.children (principal_id text, parent int,
			FOREIGN KEY (principal_id, parent) REFERENCES public.parents DEFERRABLE INITIALLY DEFERRED)`)
	pgtest.Exec(t, pool, `SELECT create_distributed_table('public.parents', 'principal_id', colocate_with => 'idem.idempotency_keys')`)
	pgtest.Exec(t, pool, `SELECT create_distributed_table('public.children', 'principal_id', colocate_with => 'idem.idempotency_keys')`)

	// Two principals whose keys live on two different workers.
	var a, b string
	if err := pool.QueryRow(ctx, `WITH p AS (
		SELECT 'p' || i AS id, (SELECT nodeport FROM citus_shards
		    WHERE shardid = get_shard_id_for_distribution_column('idem.idempotency_keys', 'p' || i)) AS port
		  FROM generate_series(0, 99) AS i)
		SELECT (SELECT min(id) FROM p WHERE port = (SELECT min(port) FROM p)), (SELECT min(id) FROM p WHERE port = (SELECT max(port) FROM p))`).Scan(&a, &b); err != nil {
		t.Fatal(err)
	}
	if a == b {
		t.Fatal("no two principals on two workers")
	}
	at := func(principal, key string) dbidem.Claim {
		c := claim(key, `{}`)
		c.Principal = principal
		return c
	}
	pgErr := func(err error) *pgconn.PgError {
		var e *pgconn.PgError
		if !errors.As(err, &e) {
			t.Fatalf("%v: not a PostgreSQL error", err)
		}
		return e
	}

	// The guard, one worker: one-phase commit, XX000.
	err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		_, err := tx.Claim(ctx, at(a, "forgot"))
		return err
	})
	if e := pgErr(err); !errors.Is(err, dbidem.ErrClaimNotCompleted) || e.Code != "XX000" || e.Routine != "ErrorIfPostCommitFailedShardPlacements" {
		t.Fatalf("a claim committed without its completion, on one worker: %v (%s %s), want ErrClaimNotCompleted from XX000", err, e.Code, e.Routine)
	}
	// The guard, two workers (the claim on one, the work on another): two-phase commit, the
	// worker's 23503.
	err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		if _, err := tx.Claim(ctx, at(a, "forgot2")); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO public.parents VALUES ($1, 1)`, b)
		return err
	})
	if e := pgErr(err); !errors.Is(err, dbidem.ErrClaimNotCompleted) || e.Code != "23503" || e.ConstraintName != "" {
		t.Fatalf("claims committed without completion, on two workers: %v (%s %q), want ErrClaimNotCompleted from a worker's 23503", err, e.Code, e.ConstraintName)
	}
	if n := pgtest.Count(t, pool, `SELECT (SELECT count(*) FROM idem.idempotency_keys) + (SELECT count(*) FROM public.parents)`); n != 0 {
		t.Fatalf("%d rows after the refused commits", n)
	}

	// An unknown principal: the worker's 23503, without table or constraint.
	err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		_, err := tx.Claim(ctx, at("mallory", "k"))
		return err
	})
	if e := pgErr(err); !errors.Is(err, dbidem.ErrUnknownPrincipal) || e.Code != "23503" || e.TableName != "" {
		t.Fatalf("an unknown principal: %v (%s %q), want ErrUnknownPrincipal from a worker's 23503", err, e.Code, e.TableName)
	}

	// A holder of the key past the lock timeout.
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := dbidem.Begin(ctx, holder, at(a, "busy")); err != nil {
		t.Fatal(err)
	}
	busy := at(a, "busy")
	busy.LockTimeout = 200 * time.Millisecond
	err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		_, err := tx.Claim(ctx, busy)
		return err
	})
	if !errors.Is(err, dbidem.ErrInProgress) || !dbidem.IsKeyWait(err) {
		t.Fatalf("a wait on a held key: %v, want ErrInProgress, a wait on the key", err)
	}
	// A lease claim of the held key (idem_begin_steps, D139) waits the lock timeout too, not
	// until the holder ends: the holder never ends before the bound below.
	busyLease := busy
	busyLease.Lease = time.Minute
	waitCtx, cancelWait := context.WithTimeout(ctx, 10*time.Second)
	start := time.Now()
	_, err = dbidem.Begin(waitCtx, pool, busyLease)
	cancelWait()
	if waited := time.Since(start); !errors.Is(err, dbidem.ErrInProgress) || !dbidem.IsKeyWait(err) || waited > 2*time.Second {
		t.Fatalf("a lease claim of a held key: %v after %v, want ErrInProgress, a wait on the key, past its 200 ms lock timeout", err, waited)
	}
	_ = holder.Rollback(ctx)

	// Work in steps through the coordinator: a lease claim records a step, yields, and the
	// takeover (same generation, same provider key) reads the step with its claim.
	steps := at(b, "steps")
	steps.Lease = time.Minute
	d1, err := dbidem.Begin(ctx, pool, steps)
	if err != nil || d1.Outcome != dbidem.Claimed || d1.RecoveryPoint != "" {
		t.Fatalf("a lease claim to work in steps: %+v %v", d1, err)
	}
	if err := dbidem.RecordStep(ctx, pool, b, "steps", d1.Attempt, "order", json.RawMessage(`{"id":41}`)); err != nil {
		t.Fatalf("a step: %v", err)
	}
	if ok, err := dbidem.Yield(ctx, pool, b, "steps", d1.Attempt); err != nil || !ok {
		t.Fatalf("a yield: %v %v", ok, err)
	}
	d2, err := dbidem.Begin(ctx, pool, steps)
	if err != nil || d2.Outcome != dbidem.Claimed || d2.Attempt == d1.Attempt || d2.ProviderKey != d1.ProviderKey ||
		d2.RecoveryPoint != "order" || string(d2.Steps["order"]) != `{"id": 41}` {
		t.Fatalf("the takeover after a yield: %+v %v, want a claim of the same generation that reads the step", d2, err)
	}
	if err := dbidem.RecordStep(ctx, pool, b, "steps", d1.Attempt, "charge", nil); !errors.Is(err, dbidem.ErrClaimLost) {
		t.Fatalf("a step of the holder that yielded: %v, want ErrClaimLost", err)
	}

	// A lost claim: a completion with another token.
	d, err := dbidem.Begin(ctx, pool, func() dbidem.Claim { c := at(b, "lease"); c.Lease = time.Minute; return c }())
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("a lease claim: %+v %v", d, err)
	}
	err = dbidem.Complete(ctx, pool, b, "lease", d.Attempt+1, dbidem.Response{Status: 200})
	if e := pgErr(err); !errors.Is(err, dbidem.ErrClaimLost) || e.Code != "55000" {
		t.Fatalf("a completion with another token: %v, want ErrClaimLost (55000)", err)
	}

	// Another table's deferred foreign key failing at the worker's COMMIT, the claim completed:
	// Citus' XX000, which a worker lost while it committed gives too
	// (TestCitusCommitLostOnAWorker), so the outcome is unknown to the client (D175).
	err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		if _, err := tx.Claim(ctx, at(a, "effect")); err != nil {
			return err
		}
		tx.CompleteOnCommit(dbidem.Response{Status: 201})
		_, err := tx.Exec(ctx, `INSERT INTO public.children VALUES ($1, 42)`, a)
		return err
	})
	if !errors.Is(err, dbidem.ErrCommitUnknown) || errors.Is(err, dbidem.ErrClaimNotCompleted) || errors.Is(err, dbidem.ErrUnknownPrincipal) {
		t.Fatalf("another table's foreign key at a worker's one-phase COMMIT: %v, want ErrCommitUnknown", err)
	}
	if e := pgErr(err); e.Code != "XX000" {
		t.Fatalf("another table's foreign key at COMMIT: %s %s, want Citus' XX000", e.Code, e.Message)
	}
	// On two workers (two-phase commit) the worker's refusal arrives at PREPARE, before
	// anything commits: the error itself, the outcome known.
	err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		if _, err := tx.Claim(ctx, at(a, "effect2")); err != nil {
			return err
		}
		tx.CompleteOnCommit(dbidem.Response{Status: 201})
		if _, err := tx.Exec(ctx, `INSERT INTO public.parents VALUES ($1, 7)`, b); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO public.children VALUES ($1, 42)`, a)
		return err
	})
	if e := pgErr(err); errors.Is(err, dbidem.ErrCommitUnknown) || errors.Is(err, dbidem.ErrClaimNotCompleted) || e.Code != "23503" {
		t.Fatalf("another table's foreign key at a two-phase COMMIT: %v (%s), want the worker's 23503 as it is", err, e.Code)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key IN ('effect', 'effect2')`); n != 0 {
		t.Fatalf("the claim of the refused transaction committed (%d rows)", n)
	}
}

// TestCitusCommitLostOnAWorker: Citus commits a transaction that ran on one worker with one
// phase, and when it does not hear the worker's COMMIT succeed it reports XX000 "could not
// commit transaction for shard N", the same error a deferred constraint's refusal gives. Here
// the worker's connection is ended while its COMMIT waits for a synchronous standby that never
// comes, after the commit is written: the client gets that XX000, yet the key, its answer and
// the work are committed. The driver said so before (a refusal: "nothing was changed") and
// says ErrCommitUnknown now (D175); the key still answers the retry.
func TestCitusCommitLostOnAWorker(t *testing.T) {
	db := pgtest.CitusDB(t)
	pgtest.CitusInstall(t, db)
	pgtest.CitusDistribute(t, db)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close) // after the worker's settings are reset, which releases a COMMIT still waiting
	pgtest.Exec(t, pool, `CREATE TABLE public.effects (principal_id text, n int)`)
	pgtest.Exec(t, pool, `SELECT create_distributed_table('public.effects', 'principal_id', colocate_with => 'idem.idempotency_keys')`)
	var port int
	if err := pool.QueryRow(ctx, `SELECT nodeport FROM citus_shards
		WHERE shardid = get_shard_id_for_distribution_column('idem.idempotency_keys', 'lost')`).Scan(&port); err != nil {
		t.Fatal(err)
	}
	_, workers := pgtest.CitusNodes(t)
	var worker *pgx.Conn
	for _, w := range workers {
		if w.Port == port {
			worker = pgtest.Connect(t, pgtest.CitusNodeURL(t, db, w))
		}
	}
	if worker == nil {
		t.Fatalf("no worker on port %d", port)
	}
	// The worker's sessions commit without waiting (synchronous_commit local) but for the one
	// that asks to: this test's transaction, by a SET LOCAL that Citus passes on to it.
	pgtest.Exec(t, worker, `ALTER SYSTEM SET synchronous_standby_names = 'idem_test_nobody'`)
	pgtest.Exec(t, worker, `ALTER SYSTEM SET synchronous_commit = 'local'`)
	pgtest.Exec(t, worker, `SELECT pg_reload_conf()`)
	t.Cleanup(func() {
		pgtest.Exec(t, worker, `ALTER SYSTEM RESET synchronous_standby_names`)
		pgtest.Exec(t, worker, `ALTER SYSTEM RESET synchronous_commit`)
		pgtest.Exec(t, worker, `SELECT pg_reload_conf()`)
	})
	done := make(chan error, 1)
	go func() {
		done <- dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
			c := claim("k", `{}`)
			c.Principal = "lost"
			if _, err := tx.Claim(ctx, c); err != nil {
				return err
			}
			tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{"n":1}`)})
			if _, err := tx.Exec(ctx, `SET LOCAL citus.propagate_set_commands = 'local'`); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `SET LOCAL synchronous_commit = on`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO public.effects VALUES ('lost', 1)`)
			return err
		})
	}()
	pgtest.WaitFor(t, worker, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`)
	pgtest.Exec(t, worker, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`)
	var pgErr *pgconn.PgError
	if err := <-done; !errors.Is(err, dbidem.ErrCommitUnknown) || !errors.As(err, &pgErr) || pgErr.Code != "XX000" {
		t.Fatalf("a worker lost while it committed: %v, want ErrCommitUnknown from Citus' XX000", err)
	}
	if n := pgtest.Count(t, pool, `SELECT (SELECT count(*) FROM public.effects) + (SELECT count(*) FROM idem.idempotency_keys WHERE state = 'c')`); n != 2 {
		t.Fatalf("%d of the effect and the completed key committed; the test needs both (the worker committed)", n)
	}
	c := claim("k", `{}`)
	c.Principal = "lost"
	if d, err := dbidem.Begin(ctx, pool, c); err != nil || d.Outcome != dbidem.Replay || d.Response.Status != 201 {
		t.Fatalf("the retry: %+v %v, want the committed answer", d, err)
	}
}

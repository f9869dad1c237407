package main

import (
	"context"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCleanupCommandByTheOwnerVacuums: docs/operations.md: "`server cleanup` run by the owner
// vacuums as the server does". `server cleanup` as the table's owner, after deleting 3000
// expired keys (far past autovacuum's threshold), runs a VACUUM of the key table (its manual
// vacuum count goes up).
func TestCleanupCommandByTheOwnerVacuums(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := startServer(t, nil)
	id, _ := s.principal("vac")
	admin := pgtest.Connect(t, s.db)
	pgtest.InsertExpired(t, admin, id, 3000)
	pgtest.Exec(t, admin, `ANALYZE idem.idempotency_keys`)
	count := func() int64 {
		c := pgtest.Connect(t, s.db)
		var n int64
		if err := c.QueryRow(ctx, `SELECT pg_stat_get_vacuum_count('idem.idempotency_keys'::regclass)`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := count()
	out, _, err := runMain(t, []string{"cleanup"}, serverEnv(s.db, nil))
	if err != nil || !strings.HasPrefix(out, "deleted 3000 expired keys") {
		t.Fatalf("server cleanup as the owner: %v, printed %q", err, out)
	}
	if after := count(); after <= before {
		t.Errorf("server cleanup run by the owner deleted 3000 keys and did not vacuum the key table (vacuum count %d, before %d)", after, before)
	}
}

// TestReceiptsWaitForADatabaseThatTakesNoWrites: the receipts' principal is read first "so a
// database that takes no writes at the moment does not stop a start once the row is there"
// (D212), but River writes as it starts, and a server with RECEIPT_URL on such a database
// (default_transaction_read_only, as a standby before its promotion) refused to start: "start
// the receipts' River client: cannot execute INSERT in a read-only transaction". It starts, says
// so, and its River client starts once the database takes writes (D214): a receipt enqueued
// then is delivered.
func TestReceiptsWaitForADatabaseThatTakesNoWrites(t *testing.T) {
	t.Parallel()
	rcv := newReceiver(t, false)
	s := startServer(t, map[string]string{"RECEIPT_URL": rcv.url}) // writes the receipts' principal
	admin := pgtest.Connect(t, s.db)
	var dbname string
	if err := admin.QueryRow(context.Background(), `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, admin, `ALTER DATABASE `+dbname+` SET default_transaction_read_only = on`)
	var log strings.Builder
	lw := &lockedWriter{w: &log}
	m := NewMain(io.Discard, lw)
	if err := m.ParseFlags(nil, serverEnv(s.db, map[string]string{"RECEIPT_URL": rcv.url})); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done; _ = m.Close() })
	select {
	case <-m.Addr:
	case err := <-done:
		t.Fatalf("a server with RECEIPT_URL on a database that takes no writes, the receipts' principal there: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("the server did not start in 30 s")
	}
	if !strings.Contains(lw.String(), "trying again") {
		t.Fatalf("the server did not say its receipts wait; its log:\n%s", lw.String())
	}
	pgtest.Exec(t, admin, `ALTER DATABASE `+dbname+` RESET default_transaction_read_only`)
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(lw.String(), "the receipts' River client started") {
		if time.Now().After(deadline) {
			t.Fatalf("the receipts' River client did not start within 30 s of the database taking writes; the log:\n%s", lw.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := m.receipts.Insert(context.Background(), receiptArgs{Principal: "p", Transfer: 7, From: 1, To: 2, Amount: 5, CreatedAt: time.Now()}, nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-rcv.arrived:
	case <-time.After(30 * time.Second):
		t.Fatal("the receipt enqueued after the River client started was not delivered within 30 s")
	}
}

type lockedWriter struct {
	mu sync.Mutex
	w  *strings.Builder
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func (l *lockedWriter) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.String()
}

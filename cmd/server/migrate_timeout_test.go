package main

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// A statement_timeout on the database (a DBA's guard rail for the API's queries, 1 s here) cut
// `server migrate`'s wait for another migrate after a second, where two migrates are
// promised to take turns, and would cut idem's own wait on tern's lock the same way (D227). The
// other migrate is stood in for by a session that holds the migrate lock for 3 s.
func TestMigrateTakesItsTurnUnderAStatementTimeout(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmptyDB(t)
	holder := pgtest.Connect(t, db)
	pgtest.Exec(t, holder, `DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET statement_timeout = %L', current_database(), '1s'); END $$`)
	pgtest.Exec(t, holder, `SELECT pg_advisory_lock(hashtextextended('pgidem server migrate', 0))`)
	released := make(chan struct{})
	time.AfterFunc(3*time.Second, func() {
		defer close(released)
		_, _ = holder.Exec(context.Background(), `SELECT pg_advisory_unlock(hashtextextended('pgidem server migrate', 0))`)
	})
	defer func() { <-released }() // before the connection's cleanup closes it
	start := time.Now()
	out, err := runCommand(t, db, "migrate")
	took := time.Since(start)
	if err != nil {
		t.Fatalf("a migrate behind another for 3 s, under a 1 s statement_timeout, after %s: %v\n%s", took, err, out)
	}
	if took < 2500*time.Millisecond {
		t.Fatalf("the migrate took %s: it did not wait for the other", took)
	}
}

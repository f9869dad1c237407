package tests

import (
	"context"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
	idemsql "github.com/pgidem/pgidem/sql"
)

// TestRebuildTakesATriggerCreatedMeanwhile: two migrates from 0.1.0 at once both run the online
// rebuild (idem.rebuild_003), whose first step adds the copying trigger to the live key table
// when it is missing. One found it missing, waited for the table's lock while the other added
// it, got the lock when the other committed, and failed with 42710 "already exists"
// (TestConcurrentMigratesFromEveryVersion, once in CI). The gap is held open here: another
// session adds the trigger in a transaction still open while the rebuild waits; the rebuild
// takes the trigger as it is when that commits.
func TestRebuildTakesATriggerCreatedMeanwhile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, conn := at010(t)
	data, err := idemsql.TemplateData(idemsql.Options{})
	if err != nil {
		t.Fatal(err)
	}
	shadow, err := idemsql.RenderOnline("online/003_shadow.sql", data)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, conn, shadow)
	other := pgtest.Connect(t, url)
	pgtest.Exec(t, other, `BEGIN`)
	pgtest.Exec(t, other, `CREATE TRIGGER idempotency_keys_copy_to_v3 AFTER INSERT OR UPDATE OR DELETE ON idem.idempotency_keys
		FOR EACH ROW EXECUTE FUNCTION idem.copy_to_v3()`)
	done := make(chan error, 1)
	go func() { _, err := conn.Exec(ctx, `CALL idem.rebuild_003(5000)`); done <- err }()
	pgtest.WaitUntilBlocked(t, other, conn.PgConn().PID())
	pgtest.Exec(t, other, `COMMIT`)
	if err := <-done; err != nil {
		t.Fatalf("the rebuild, which waited for the table while another session added its trigger: %v; want the trigger taken as it is", err)
	}
	if n := pgtest.Count(t, other, `SELECT count(*) FROM pg_trigger WHERE tgname = 'idempotency_keys_copy_to_v3'`); n != 1 {
		t.Fatalf("%d copying triggers", n)
	}
}

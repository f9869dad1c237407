package tests

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
	"github.com/pgidem/pgidem/internal/release010"
	idemsql "github.com/pgidem/pgidem/sql"
)

// TestBundleUnderAutocommitOff: sql/idem.sql run as the docs show it (psql without -X, so the
// user's psqlrc is read) by a user whose psqlrc sets AUTOCOMMIT off. From 0.1.0 its online
// rebuild (a procedure that commits) failed with "invalid transaction termination", and from
// 0.2.0 the 007 column step's lock on the key table was kept to the file's end. The bundle now
// sets AUTOCOMMIT on itself: the upgrade from 0.1.0 goes through. D259.
func TestBundleUnderAutocommitOff(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, conn := at010(t)
	if err := release010.Fill(ctx, conn, 100); err != nil {
		t.Fatal(err)
	}
	rc := filepath.Join(t.TempDir(), "psqlrc")
	if err := os.WriteFile(rc, []byte("\\set AUTOCOMMIT off\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := psqlCommand(t, url, "-v", "ON_ERROR_STOP=1", "-f", bundle)
	// As the docs run it: without -X, the psqlrc read.
	args := cmd.Args[:1]
	for _, a := range cmd.Args[1:] {
		if a != "-X" {
			args = append(args, a)
		}
	}
	cmd.Args = args
	cmd.Env = append(cmd.Env, "PSQLRC="+rc)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("psql -f sql/idem.sql with AUTOCOMMIT off in the psqlrc, from 0.1.0: %v\n%s", err, out)
	}
	var v int
	if err := conn.QueryRow(ctx, `SELECT version FROM idem.schema_version`).Scan(&v); err != nil || v != idemsql.Version() {
		t.Fatalf("schema version after the bundle: %d (%v), want %d", v, err, idemsql.Version())
	}
}

// at010 is an empty database with release 0.1.0 installed as its `server migrate` did, and a
// connection to it as the owner.
func at010(t *testing.T) (string, *pgx.Conn) {
	t.Helper()
	url := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, url)
	if err := release010.Install(context.Background(), conn); err != nil {
		t.Fatal(err)
	}
	return url, conn
}

package idemtest_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/idem/idemtest"
)

// OwnerURL is the migrate step's role as production has it: it owns the database and is no
// superuser, and the migrate runs as it (a black-box review had to build the role by hand:
// NewEmptyDB's role is the server's superuser).
func TestOwnerURLMigratesAsAPlainOwner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner := idemtest.OwnerURL(t, idemtest.NewEmptyDB(t))
	conn, err := pgx.Connect(ctx, owner)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var super, createRole, createDB, owns bool
	if err := conn.QueryRow(ctx, `SELECT rolsuper, rolcreaterole, rolcreatedb,
		(SELECT datdba = r.oid FROM pg_database WHERE datname = current_database())
		FROM pg_roles r WHERE rolname = current_user`).Scan(&super, &createRole, &createDB, &owns); err != nil {
		t.Fatal(err)
	}
	if super || createRole || createDB || !owns {
		t.Fatalf("OwnerURL's role: superuser %v, createrole %v, createdb %v, owns the database %v; want only the owner", super, createRole, createDB, owns)
	}
	if err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{}); err != nil {
		t.Fatalf("Migrate as the plain owner: %v", err)
	}
	var ownsSchema bool
	if err := conn.QueryRow(ctx, `SELECT nspowner::regrole::text = current_user::text FROM pg_namespace WHERE nspname = 'idem'`).Scan(&ownsSchema); err != nil {
		t.Fatal(err)
	}
	if !ownsSchema {
		t.Errorf("schema idem is not the plain owner's")
	}
}

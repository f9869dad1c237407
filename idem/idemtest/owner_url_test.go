package idemtest_test

import (
	"context"
	"fmt"
	"os"
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

// TEST_DATABASE_URL may name a role that may create databases and roles without being a
// superuser: OwnerURL gives such a role's database away too (it makes the new role one it is a
// member of, as PostgreSQL asks), and quotes a database name that needs it.
func TestOwnerURLByANonSuperuserCreator(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := idemtest.NewEmptyDB(t)
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(ctx) }) // after the drops below
	creator := fmt.Sprintf("idemtest_owner_creator_%d", os.Getpid())
	db := fmt.Sprintf("Owner-URL %d", os.Getpid())
	if _, err := admin.Exec(ctx, `CREATE ROLE `+creator+` LOGIN PASSWORD 'creator' CREATEDB CREATEROLE`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(ctx, `DROP DATABASE IF EXISTS `+pgx.Identifier{db}.Sanitize()+` WITH (FORCE)`); err != nil {
			t.Error(err)
		}
		if _, err := admin.Exec(ctx, `DROP OWNED BY `+creator+`; DROP ROLE `+creator); err != nil {
			t.Error(err)
		}
	})
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	c, err := pgx.Connect(ctx, fmt.Sprintf("host=%s port=%d dbname=%s user=%s password=creator", cfg.Host, cfg.Port, cfg.Database, creator))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{db}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	c.Close(ctx)
	asCreator := fmt.Sprintf("host=%s port=%d dbname='%s' user=%s password=creator", cfg.Host, cfg.Port, db, creator)
	var owns bool
	t.Run("owner", func(t *testing.T) {
		oc, err := pgx.Connect(ctx, idemtest.OwnerURL(t, asCreator))
		if err != nil {
			t.Fatal(err)
		}
		defer oc.Close(ctx)
		if err := oc.QueryRow(ctx, `SELECT datdba = (SELECT oid FROM pg_roles WHERE rolname = current_user) FROM pg_database WHERE datname = current_database()`).Scan(&owns); err != nil {
			t.Fatal(err)
		}
	})
	if !owns {
		t.Errorf("OwnerURL by a creator that is no superuser: the new role does not own %q", db)
	}
}

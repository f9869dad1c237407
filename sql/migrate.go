// Package idemsql carries the SQL of idem (the tern migrations in migrations/ and the
// PL/pgSQL API in functions/) inside the binary and installs it.
//
// The server's migrate command and the test harness both call [Migrate], so what the tests
// run against is exactly what an operator installs.
package idemsql

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"regexp"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/tern/v2/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

//go:embed functions/*.sql functions/include/*.sql
var functionFiles embed.FS

// DefaultAppRole is the NOLOGIN role that is granted EXECUTE on the API functions.
const DefaultAppRole = "idem_app"

// VersionTable is the tern version table of the idem migrations.
const VersionTable = "idem.schema_version"

// Options configure [Migrate]. The zero value installs with the defaults.
type Options struct {
	// AppRole is the role granted USAGE on schema idem and EXECUTE on the API functions.
	// Default DefaultAppRole. It must be a lower-case SQL identifier (a-z, 0-9, _; at most
	// 63 bytes); it is created NOLOGIN when it does not exist.
	AppRole string
}

var roleName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// Migrations returns the tern migrations (files named NNN_name.sql).
func Migrations() fs.FS {
	sub, _ := fs.Sub(migrationFiles, "migrations")
	return sub
}

// Version is the schema version these migrations bring a database to (the number of
// migrations): idem.schema_version holds it once Migrate has run.
func Version() int {
	paths, _ := migrate.FindMigrations(Migrations())
	return len(paths)
}

// Functions returns the tern code package of the SQL API (install.sql and one file per
// function).
func Functions() fs.FS {
	sub, _ := fs.Sub(functionFiles, "functions")
	return sub
}

// Migrate applies every pending migration and then (re)installs the SQL API functions.
// It is safe to run any number of times and from several processes at once: tern serializes
// both steps with an advisory lock. The connection's role becomes the owner of the schema
// objects, and the SECURITY DEFINER functions run as that role.
func Migrate(ctx context.Context, conn *pgx.Conn, opts Options) error {
	role := opts.AppRole
	if role == "" {
		role = DefaultAppRole
	}
	if !roleName.MatchString(role) {
		return fmt.Errorf("idem migrate: app role %q is not a lower-case SQL identifier", role)
	}
	data := map[string]any{"app_role": role}

	// tern keeps its version table inside the schema, so the schema comes first.
	if _, err := conn.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS idem"); err != nil {
		return fmt.Errorf("idem migrate: create schema: %w", err)
	}
	m, err := migrate.NewMigrator(ctx, conn, VersionTable)
	if err != nil {
		return fmt.Errorf("idem migrate: %w", err)
	}
	m.Data = data
	if err := m.LoadMigrations(Migrations()); err != nil {
		return fmt.Errorf("idem migrate: load migrations: %w", err)
	}
	if err := m.Migrate(ctx); err != nil {
		return fmt.Errorf("idem migrate: %w", err)
	}
	code, err := migrate.LoadCodePackage(Functions())
	if err != nil {
		return fmt.Errorf("idem migrate: load functions: %w", err)
	}
	if err := migrate.InstallCodePackage(ctx, conn, data, code); err != nil {
		return fmt.Errorf("idem migrate: install functions: %w", err)
	}
	return nil
}

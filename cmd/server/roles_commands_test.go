package main

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"
)

// TestRolesServerCommandsAsTheWrongRole: docs/operations.md "Roles": the servers log in as a
// member of idem_app ("serve, cleanup and principal create need nothing else"); "Operators":
// `server keys` as a member of idem_operator. A command run as the other role must fail with a
// message that says the role lacks a privilege (permission denied, 42501, naming what to
// grant), not "database not migrated: run `server migrate`" (which sends the operator to run a
// migration that changes nothing) and not a hang.
func TestRolesServerCommandsAsTheWrongRole(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	ops := loginRoleIn(t, s.db, "idem_operator")
	app := loginRoleIn(t, s.db, "idem_app")
	for _, c := range []struct {
		role string
		url  string
		args []string
	}{
		{"idem_operator", ops, []string{"principal", "create", "roles"}},
		{"idem_operator", ops, []string{"cleanup"}},
		{"idem_app", app, []string{"keys", "release", "p", "k", "1", "roles"}},
		{"idem_app", app, []string{"keys", "stuck"}},
	} {
		out, err := runCommand(t, c.url, c.args...)
		if err == nil || !strings.Contains(err.Error(), "permission denied") || strings.Contains(err.Error(), "not migrated") {
			t.Errorf("server %s as a member of %s only: %v (out %q), want a permission error", strings.Join(c.args, " "), c.role, err, out)
		}
	}
}

// TestRolesServeAsOperatorStops: `server serve` with DATABASE_URL of a member of idem_operator
// (a person's role, docs/operations.md "Who may do what": the API is idem_app's) stops at start
// with a permission error, instead of serving 500s.
func TestRolesServeAsOperatorStops(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	ops := loginRoleIn(t, s.db, "idem_operator")
	m := NewMain(io.Discard, io.Discard)
	if err := m.ParseFlags(nil, serverEnv(ops, nil)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	defer m.Close()
	select {
	case addr := <-m.Addr:
		cancel()
		<-done
		t.Fatalf("serve as a member of idem_operator started on %s", addr)
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "permission denied") || strings.Contains(err.Error(), "not migrated") {
			t.Fatalf("serve as a member of idem_operator: %v, want a permission error", err)
		}
	}
}

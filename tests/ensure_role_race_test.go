package tests

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"text/template"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestEnsureRoleTakesARoleCreatedMeanwhile: the install's block that makes a missing role
// (include/ensure_role.sql: every install, for an application role no migration made, such as
// an IDEM_APP_ROLE changed after the first install) meets another database's install that
// creates the same role in a transaction still open. Roles are the cluster's and tern's lock is
// the database's, so nothing keeps the two apart: the block waited on the other's catalog row
// and failed with 23505 once it committed (D245). The gap is held open here with the other
// install's transaction: the block waits on its row, and takes the role when it commits.
func TestEnsureRoleTakesARoleCreatedMeanwhile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	text, err := os.ReadFile("../sql/functions/include/ensure_role.sql")
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := template.New("ensure_role").Parse(string(text))
	if err != nil {
		t.Fatal(err)
	}
	role := fmt.Sprintf("race_role_%d", os.Getpid())
	var block strings.Builder
	if err := tmpl.Execute(&block, role); err != nil {
		t.Fatal(err)
	}
	first, second := pgtest.Connect(t, pgtest.NewEmptyDB(t)), pgtest.Connect(t, pgtest.NewEmptyDB(t))
	t.Cleanup(func() { _, _ = first.Exec(context.Background(), `DROP ROLE IF EXISTS `+role) })
	pgtest.Exec(t, first, `BEGIN`)
	pgtest.Exec(t, first, block.String())
	done := make(chan error, 1)
	go func() { _, err := second.Exec(ctx, block.String()); done <- err }()
	pgtest.WaitUntilBlocked(t, first, second.PgConn().PID())
	pgtest.Exec(t, first, `COMMIT`)
	if err := <-done; err != nil {
		t.Fatalf("the second database's install, which waited on the first's new role until it committed: %v; want the role taken as it is", err)
	}
	if n := pgtest.Count(t, second, `SELECT count(*) FROM pg_roles WHERE rolname = $1`, role); n != 1 {
		t.Fatalf("%d roles named %s", n, role)
	}
}

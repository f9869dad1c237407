package tests

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
	idemsql "github.com/pgidem/pgidem/sql"
)

// TestInstallAsAnOwnerWhoseNameNeedsQuotes: the owner of schema idem may have any role name.
// The install's take-back of default privileges (D199) found the installing role as
// current_user::regrole, which reads the name as SQL would: an owner named with a capital
// letter or a hyphen failed every install and upgrade ("invalid name syntax" or "role does not
// exist"). It looks the role up by its name now. Through Go (Migrate) and psql (sql/idem.sql).
func TestInstallAsAnOwnerWhoseNameNeedsQuotes(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, via := range []string{"Migrate", "psql"} {
		db := pgtest.NewEmptyDB(t)
		cfg, err := pgx.ParseConfig(db)
		if err != nil {
			t.Fatal(err)
		}
		name := fmt.Sprintf("Shop-Owner_%s_%d", via, os.Getpid())
		quoted := pgx.Identifier{name}.Sanitize()
		admin := pgtest.Connect(t, db)
		pgtest.Exec(t, admin, `CREATE ROLE `+quoted+` LOGIN PASSWORD 'owner-secret'; ALTER DATABASE `+
			pgx.Identifier{cfg.Database}.Sanitize()+` OWNER TO `+quoted)
		t.Cleanup(func() {
			c, err := pgx.Connect(context.Background(), db)
			if err != nil {
				return
			}
			defer c.Close(context.Background())
			_, _ = c.Exec(context.Background(), `DROP OWNED BY `+quoted+`; DROP ROLE `+quoted)
		})
		ownerURL := pgtest.AsRole(t, db, name, "owner-secret")
		// The owner's own default privileges, which the take-back reads.
		owner := pgtest.Connect(t, ownerURL)
		pgtest.Exec(t, owner, `ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON FUNCTIONS TO PUBLIC`)
		if via == "Migrate" {
			if err := idemsql.Migrate(ctx, owner, idemsql.Options{}); err != nil {
				t.Fatalf("install as %s through Migrate: %v", quoted, err)
			}
		} else {
			script, err := os.ReadFile("../sql/idem.sql")
			if err != nil {
				t.Fatal(err)
			}
			psql(t, ownerURL, script, "-v", "ON_ERROR_STOP=1")
		}
		if n := pgtest.Count(t, admin, `SELECT count(*) FROM pg_catalog.pg_namespace WHERE nspname = 'idem' AND nspowner = (SELECT oid FROM pg_roles WHERE rolname = $1)`, name); n != 1 {
			t.Fatalf("%s: schema idem owned by %s: %d", via, quoted, n)
		}
	}
}

package pgtest

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
)

var optionedDBs atomic.Int64

// NewDatabaseWith creates an empty database from template0 with the CREATE DATABASE options
// opts (ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C', an ICU locale ...), as the harness's
// superuser, and returns its connection string; it is dropped when the test ends. Nothing is
// installed in it: a database an operator made for another application.
func NewDatabaseWith(t testing.TB, opts string) string {
	t.Helper()
	base := NewEmptyDB(t)
	name := fmt.Sprintf("optioned_%d_%d", os.Getpid(), optionedDBs.Add(1))
	Exec(t, Connect(t, base), "CREATE DATABASE "+name+" TEMPLATE template0 "+opts)
	t.Cleanup(func() {
		ctx := context.Background()
		c, err := pgx.Connect(ctx, base)
		if err != nil {
			return
		}
		defer c.Close(ctx)
		_, _ = c.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	})
	if u, err := url.Parse(base); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + name
		return u.String()
	}
	return base + " dbname=" + name
}

package idemmigrate_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/idem/idemtest"
)

func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }

// The owner's migrate step: run it at every release, before the services start; on a database
// that is up to date it changes nothing. A service then only checks the version.
func ExampleMigrate() {
	ctx := context.Background()
	url := idemtest.ExampleDB() // as the role that owns schema idem
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{}); err != nil {
		log.Fatal(err)
	}
	fmt.Println(idem.CheckSchema(ctx, conn), idemmigrate.Version() == idem.SchemaVersion())
	// Output:
	// <nil> true
}

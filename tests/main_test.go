// Package tests holds the integration tests of idem against a real PostgreSQL: concurrency
// of the SQL API, the migrations read back from pg_catalog, and the pgTAP suite in tests/sql.
package tests

import (
	"os"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

package tests

import (
	"strings"
	"testing"
)

// heavy are the modules a service must not link just because it imports package idem or
// idemclient: routers, metric clients, migration tools and their template libraries, an
// OpenTelemetry SDK, a job queue (River: package idemriver), and this repository's test machinery.
var heavy = []string{
	"github.com/gorilla/mux",
	"github.com/prometheus/",
	"github.com/jackc/tern",
	"github.com/Masterminds/",
	"go.opentelemetry.io/otel/sdk",
	"github.com/testcontainers/",
	"github.com/Shopify/toxiproxy",
	"github.com/riverqueue/",
	"github.com/rs/zerolog",
}

// idemsql is package sql (tern's migrator); its subpackage sql/migrations only embeds files.
const idemsqlPkg = "github.com/pgidem/pgidem/sql"

// TestPublicPackagesAreLight: `go list -deps` of package idem, and of idemclient, holds none of
// the heavy modules (idem's Prometheus adapter, gorilla/mux adapter and migrate live in
// subpackages; tracing uses OpenTelemetry's trace API only), and idemclient holds no pgx
// either: a service that calls a keyed API does not link a database driver.
func TestPublicPackagesAreLight(t *testing.T) {
	t.Parallel()
	for _, pkg := range []string{"../idem", "../idemclient", "../idem/idemmux"} {
		deps := goCmd(t, ".", nil, "list", "-deps", pkg)
		for _, dep := range strings.Fields(deps) {
			for _, h := range heavy {
				if strings.HasPrefix(dep, h) && !(pkg == "../idem/idemmux" && h == "github.com/gorilla/mux") {
					t.Errorf("%s depends on %s", pkg, dep)
				}
			}
			if dep == idemsqlPkg {
				t.Errorf("%s depends on %s", pkg, dep)
			}
			if pkg == "../idemclient" && strings.HasPrefix(dep, "github.com/jackc/") {
				t.Errorf("idemclient depends on %s", dep)
			}
		}
	}
}

// TestServerUsesThePublicAPI: the reference server imports none of the library's internal
// packages (its own helpers, such as the private cluster, may stay internal): what a real
// service needs is all in the public packages.
func TestServerUsesThePublicAPI(t *testing.T) {
	t.Parallel()
	imports := goCmd(t, ".", nil, "list", "-f", `{{join .Imports "\n"}}`, "../cmd/server")
	for _, imp := range strings.Fields(imports) {
		for _, internal := range []string{"internal/dbidem", "internal/http", "internal/canon", "internal/client"} {
			if imp == "github.com/pgidem/pgidem/"+internal {
				t.Errorf("cmd/server imports %s", imp)
			}
		}
	}
	if !strings.Contains(imports, "github.com/pgidem/pgidem/idem\n") {
		t.Fatalf("cmd/server does not import package idem: %s", imports)
	}
}

package tests

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// goCmd runs the go command in dir with env added, and fails the test with its output.
func goCmd(t *testing.T, dir string, env []string, args ...string) string {
	t.Helper()
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go %s in %s: %v\n%s", strings.Join(args, " "), dir, err, out)
	}
	return string(out)
}

// shopRoles makes an empty database of the test server for the example shop, a login role
// that owns it (and is nothing more: the migrate step runs as it) and a login role that is
// only a member of idem_app (the shop serves as it), and returns their connection strings.
func shopRoles(t *testing.T) (owner, app string) {
	t.Helper()
	db := pgtest.NewEmptyDB(t)
	return pgtest.OwnerRole(t, db), pgtest.LoginRole(t, db, "idem_app")
}

// TestExampleShop runs the example service's own test (examples/shop, a module of its own that
// imports this one through a replace) against a database of the test server, the migrate step
// as the database's owner and the shop as a member of idem_app: the import paths, the wiring
// of the public packages and the two roles cannot rot unnoticed.
func TestExampleShop(t *testing.T) {
	t.Parallel()
	owner, app := shopRoles(t)
	goCmd(t, "../examples/shop", nil, "vet", "./...")
	goCmd(t, "../examples/shop", []string{"TEST_DATABASE_URL=" + owner, "TEST_APP_DATABASE_URL=" + app}, "test", "-count=1", "./...")
}

// TestHTTPDocWiringIsTheExample: the wiring that docs/http.md shows is examples/shop/main.go
// and examples/shop/migrate/main.go, byte for byte; its "Work in steps" example is
// idem/example_steps_test.go (ExampleStep, which `go test ./idem` runs and checks), and its "Work
// after the answer" example is idem/idemriver/example_test.go.
func TestHTTPDocWiringIsTheExample(t *testing.T) {
	t.Parallel()
	for _, f := range []struct{ path, begin, end string }{
		{"../examples/shop/main.go", "<!-- shop:begin", "<!-- shop:end -->"},
		{"../examples/shop/migrate/main.go", "<!-- shop-migrate:begin", "<!-- shop-migrate:end -->"},
		{"../idem/idemriver/example_test.go", "<!-- idemriver-example:begin", "<!-- idemriver-example:end -->"},
		{"../idem/example_steps_test.go", "<!-- steps:begin", "<!-- steps:end -->"},
	} {
		src, err := os.ReadFile(f.path)
		if err != nil {
			t.Fatal(err)
		}
		checkDocBlock(t, "../docs/http.md", f.begin, f.end, "```go\n"+string(src)+"```\n")
	}
}

// TestWiringBuildsInAFreshModule does what a new user does: a module of their own (`go mod
// init example.com/shop`, a replace to this checkout), the wiring of docs/http.md as its
// main.go and migrate/main.go, built and run against a fresh database as the two roles: the
// shop refuses to start before the migrate (saying what to run), the migrate step runs as the
// database's owner, and the shop, as a member of idem_app, serves a keyed POST and replays it.
// The module's requirements hold none of the heavy modules (no router, no metrics client).
func TestWiringBuildsInAFreshModule(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, f := range []string{"main.go", "migrate/main.go"} {
		src, err := os.ReadFile(filepath.Join("../examples/shop", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, f)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), src, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	goCmd(t, dir, nil, "mod", "init", "example.com/shop")
	// docs/http.md's two commands for a checkout. tidy may fetch the go.mod files of modules
	// this module's build never needed (from the module proxy, as .ci/run's downloads do).
	env := []string{"GOFLAGS=-mod=mod"}
	goCmd(t, dir, env, "mod", "edit", "-replace", "github.com/pgidem/pgidem="+root)
	// The checksums of this module's dependencies, which tidy would otherwise check against
	// the checksum database (a user's machine asks it; this test does not need to).
	sum, err := os.ReadFile("../go.sum")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644); err != nil {
		t.Fatal(err)
	}
	goCmd(t, dir, env, "mod", "tidy")
	gomod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{"github.com/gorilla/mux", "github.com/prometheus/", "go.opentelemetry.io/otel/sdk", "testcontainers"} {
		if strings.Contains(string(gomod), h) {
			t.Errorf("the shop's go.mod requires %s:\n%s", h, gomod)
		}
	}
	shopBin, migrateBin := filepath.Join(dir, "shop"), filepath.Join(dir, "shop-migrate")
	goCmd(t, dir, env, "build", "-o", shopBin, ".")
	goCmd(t, dir, env, "build", "-o", migrateBin, "./migrate")
	deps := goCmd(t, dir, env, "list", "-deps", ".")
	if strings.Contains(deps, "github.com/jackc/tern") {
		t.Errorf("the shop links tern: the migrate step belongs to its own binary")
	}

	owner, app := shopRoles(t)
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	early := exec.Command(shopBin)
	early.Env = append(os.Environ(), "DATABASE_URL="+app, "LISTEN_ADDR="+addr)
	if out, err := early.CombinedOutput(); err == nil || !strings.Contains(string(out), "idemmigrate.Migrate") {
		t.Fatalf("the shop before the migrate: %v\n%s\nwant it to stop, naming the migrate", err, out)
	}
	mig := exec.Command(migrateBin)
	appCfg, err := pgx.ParseConfig(app)
	if err != nil {
		t.Fatal(err)
	}
	mig.Env = append(os.Environ(), "DATABASE_URL="+owner, "SHOP_APP_ROLE="+appCfg.User)
	if out, err := mig.CombinedOutput(); err != nil {
		t.Fatalf("the migrate step as the owner: %v\n%s", err, out)
	}

	shop := exec.Command(shopBin)
	shop.Env = append(os.Environ(), "DATABASE_URL="+app, "LISTEN_ADDR="+addr)
	var log strings.Builder
	shop.Stdout, shop.Stderr = &log, &log
	if err := shop.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = shop.Process.Kill(); _ = shop.Wait() })
	post := func() (int, string, string) {
		status, header, body := pgtest.Send(t, context.Background(), "POST", "http://"+addr+"/orders", `{"sku":"a1","qty":2}`,
			"X-Customer", "c1", "Idempotency-Key", "o-1")
		return status, header.Get("Idempotent-Replayed"), body
	}
	var status int
	var replayed, first string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if status, replayed, first = post(); status != -1 || time.Now().After(deadline) {
			break
		}
	}
	if status != 201 || replayed != "" {
		t.Fatalf("the first order: %d %q %s\n%s", status, replayed, first, log.String())
	}
	if status, replayed, again := post(); status != 201 || replayed != "true" || again != first {
		t.Fatalf("its retry: %d %q %s, want the replay of %s", status, replayed, again, first)
	}
}

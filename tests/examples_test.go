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

// TestExampleShop runs the example service's own test (examples/shop, a module of its own that
// imports this one through a replace) against a database of the test server: the import
// paths and the wiring of the public packages cannot rot unnoticed.
func TestExampleShop(t *testing.T) {
	t.Parallel()
	goCmd(t, "../examples/shop", nil, "vet", "./...")
	goCmd(t, "../examples/shop", []string{"TEST_DATABASE_URL=" + pgtest.NewEmptyDB(t)}, "test", "-count=1", "./...")
}

// TestHTTPDocWiringIsTheExample: the wiring that docs/http.md shows is examples/shop/main.go,
// byte for byte.
func TestHTTPDocWiringIsTheExample(t *testing.T) {
	t.Parallel()
	main, err := os.ReadFile("../examples/shop/main.go")
	if err != nil {
		t.Fatal(err)
	}
	checkDocBlock(t, "../docs/http.md", "<!-- shop:begin", "<!-- shop:end -->", "```go\n"+string(main)+"```\n")
}

// TestWiringBuildsInAFreshModule does what a new user does: a module of their own (`go mod
// init example.com/shop`, a replace to this checkout), the wiring of docs/http.md as its
// main.go, built and run against a fresh database; it serves a keyed POST and replays it.
func TestWiringBuildsInAFreshModule(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	main, err := os.ReadFile("../examples/shop/main.go")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), main, 0o644); err != nil {
		t.Fatal(err)
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
	bin := filepath.Join(dir, "shop")
	goCmd(t, dir, env, "build", "-o", bin, ".")

	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	shop := exec.Command(bin)
	shop.Env = append(os.Environ(), "DATABASE_URL="+pgtest.NewEmptyDB(t), "LISTEN_ADDR="+addr)
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

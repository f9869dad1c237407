package tests

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestDocGoFragmentsCompile: the Go fragments of docs/http.md and docs/operations.md that are
// not whole files (the whole ones are the examples, byte for byte) are compiled as the docs
// show them, each inside a function with the names it assumes declared around it (a pool, a
// token, a provider's client), so that a renamed or changed API is caught in the docs too.
func TestDocGoFragmentsCompile(t *testing.T) {
	t.Parallel()
	type fragment struct {
		path, marker string
		// wrap is the file around the fragment, %s where it goes
		wrap string
	}
	frags := []fragment{
		{"../docs/http.md", "`idem.StartCleaner` starts the\ncleaner in one call", `
func cleanerFragment(ctx context.Context, pool *pgxpool.Pool) error {
%s
	return nil
}`},
		{"../docs/http.md", "a client that reuses its key for a new\npayment after the old one expired", `
func writeJSON(w http.ResponseWriter, status int, v any) {}

%s`},
		{"../docs/http.md", "The other half of idempotency is the client", `
func clientFragment(token string) error {
%s
	return nil
}`},
		{"../docs/operations.md", "A Go service that commits transactions of its\nown next to a synchronous standby", `
func commitFragment(ctx context.Context, tx pgx.Tx) error {
%s
}`},
	}
	var files []string
	for _, f := range frags {
		block := docBlock(t, f.path, f.marker, "go")
		files = append(files, fmt.Sprintf("// from %s, after %q\n%s\n", f.path, strings.SplitN(f.marker, "\n", 2)[0], fmt.Sprintf(f.wrap, block)))
	}
	// Inside this module (its go.mod resolves the imports offline), in a directory that the
	// module's ./... patterns skip (a leading underscore), removed after.
	dir, err := os.MkdirTemp(".", "_docfragments")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.MkdirAll(filepath.Join(dir, "bank"), 0o755); err != nil {
		t.Fatal(err)
	}
	write := func(name, text string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// the provider's client the payout fragment calls
	write("bank/bank.go", `package bank

import "context"

type Payment struct {
	IdempotencyKey string
	Account, Amount int64
}

func Pay(ctx context.Context, p Payment) (any, error) { return nil, nil }
`)
	pkg := filepath.Base(dir)
	write("fragments.go", `package docfragments

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idemclient"
	"github.com/pgidem/pgidem/tests/`+pkg+`/bank"
)

var (
	_ = errors.Is
	_ = fmt.Println
	_ = strings.NewReader
	_ = time.Second
	_ = idem.ClaimOf
	_ idemclient.Client
	_ pgx.Tx
	_ *pgxpool.Pool
	_ = bank.Pay
)

`+strings.Join(files, "\n"))
	args := []string{"build", "-o", os.DevNull}
	if raceEnabled {
		args = append(args, "-race") // the packages the test binary was built from, cached as they are
	}
	cmd := exec.Command("go", append(args, "./"+pkg)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		src, _ := os.ReadFile(filepath.Join(dir, "fragments.go"))
		t.Fatalf("the docs' Go fragments do not compile: %v\n%s\n%s", err, out, src)
	}
}

package main

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
)

// TestShop: the migrate step as the database's owner, then the shop as a role that is only a
// member of idem_app: an order, its retry (the same answer, replayed), another order under
// the same key (422), and one order in the table. Before the migrate the shop refuses to
// start, saying what to run. It needs two connection strings to one empty database:
// TEST_DATABASE_URL as its owner, TEST_APP_DATABASE_URL as a login role in idem_app (the
// repository's tests/examples_test.go makes both), which the migrate step grants the shop's
// table to.
func TestShop(t *testing.T) {
	ownerURL, appURL := os.Getenv("TEST_DATABASE_URL"), os.Getenv("TEST_APP_DATABASE_URL")
	if ownerURL == "" || appURL == "" {
		t.Fatal("set TEST_DATABASE_URL (the database's owner) and TEST_APP_DATABASE_URL (a login role in idem_app); the repository's make test does")
	}
	ctx := context.Background()
	app, err := pgxpool.New(ctx, appURL)
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()

	if _, err := newShop(ctx, app); !errors.Is(err, idem.ErrNotMigrated) || !strings.Contains(err.Error(), "idemmigrate.Migrate") {
		t.Fatalf("the shop before the migrate: %v, want the not-migrated error naming the fix", err)
	}
	for range 2 { // the migrate step can run again
		cmd := exec.Command("go", "run", "./migrate")
		// The shop's table is granted to the shop's own login role, not to idem_app.
		cmd.Env = append(os.Environ(), "DATABASE_URL="+ownerURL, "SHOP_APP_ROLE="+app.Config().ConnConfig.User)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("migrate as the owner: %v\n%s", err, out)
		}
	}
	s, err := newShop(ctx, app)
	if err != nil {
		t.Fatalf("the shop as the application role: %v", err)
	}
	defer s.cleaner.Stop()
	srv := httptest.NewServer(s.handler)
	defer srv.Close()
	post := func(body string) *http.Response {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(body))
		req.Header.Set("X-Customer", "c1")
		req.Header.Set("Idempotency-Key", "order-1")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		return res
	}
	if res := post(`{"sku":"a1","qty":2}`); res.StatusCode != 201 {
		t.Fatalf("the order: %d", res.StatusCode)
	}
	if res := post(`{"sku":"a1","qty":2}`); res.StatusCode != 201 || res.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("its retry: %d %v", res.StatusCode, res.Header)
	}
	if res := post(`{"sku":"a1","qty":3}`); res.StatusCode != 422 {
		t.Fatalf("another order under the key: %d", res.StatusCode)
	}
	// Without a customer the middleware asks no key and claims nothing: the handler refuses it.
	anon, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"sku":"a1","qty":2}`))
	anon.Header.Set("Idempotency-Key", "order-1")
	if res, err := http.DefaultClient.Do(anon); err != nil || res.StatusCode != 401 {
		t.Fatalf("an order without a customer: %v %v, want 401", res, err)
	} else {
		res.Body.Close()
	}
	var n int
	if err := app.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d orders, %v; want 1", n, err)
	}
	if _, err := app.Exec(ctx, `CREATE TABLE intruder (id int)`); err == nil {
		t.Fatal("the application role may create tables: it is not the least-privilege role")
	}
}
